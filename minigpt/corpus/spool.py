"""Temporary files in the cache: named for the process and machine writing them, so a later run can remove
those whose writer was killed (minigpt.corpus.store.remove_stale_temps); among them the capped, decompressed
copy a compressed Parquet file is read from (Parquet is read from its end, which a stream does not have).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

# a decompressed copy holds at most this many times its file's size on disk, and this much at least: text
# compresses a few times over, so past it the file is a bomb, not a corpus; and the copy, in the cache,
# never fills the disk from a small file
SPOOL_RATIO = 100
SPOOL_FLOOR = 64_000_000


def host() -> str:
    """This machine's name as temp file names carry it (a name may hold any byte but NUL)."""
    return re.sub(r"[@/\\]", "_", socket.gethostname())


def temp_path(final: Path) -> Path:
    """Where this process writes `final` before renaming it: .<name>.<pid>@<host>.tmp beside it."""
    return final.with_name(f".{final.name}.{os.getpid()}@{host()}.tmp")


def spool_cap(size_on_disk: int) -> int:
    """The most bytes a decompressed copy of a file of this size may hold."""
    return max(SPOOL_FLOOR, SPOOL_RATIO * size_on_disk)


@contextlib.contextmanager
def spooled(
    blocks: Iterator[bytes], folder: Path, cap: int, too_large: Callable[[], Exception]
) -> Iterator[Path]:
    """A temp file in `folder` holding the blocks, removed on every way out; `too_large()` is raised
    before the file would pass `cap` bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = temp_path(folder / f"{secrets.token_hex(8)}.spool")
    try:
        with open(path, "xb") as out:
            _copy(blocks, out, cap, too_large)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _copy(blocks: Iterator[bytes], out: IO[bytes], cap: int, too_large: Callable[[], Exception]) -> None:
    written = 0
    for block in blocks:
        written += len(block)
        if written > cap:
            raise too_large()
        out.write(block)
