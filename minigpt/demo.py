"""The built-in demo corpus: Python's own reference documentation, shipped with every Python."""

from __future__ import annotations

from pathlib import Path

from minigpt.errors import MinigptError
from minigpt.files import atomic_write_bytes

DEMO_PROMPT = "The "


def demo_text() -> str:
    """The text of the language reference topics that `help()` shows (about 450 KB, plain English + code)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise MinigptError(
            "this Python has no pydoc_data (some distributions strip it): train on a file of your own "
            "with `minigpt train FILE`"
        ) from None
    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"


def write_demo_text(path: Path) -> Path:
    """Write the demo corpus to `path` (once; it never changes for a given Python) and return it."""
    data = demo_text().encode("utf-8")
    if not path.is_file() or path.read_bytes() != data:
        atomic_write_bytes(path, data)
    return path
