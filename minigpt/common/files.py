"""Safe file I/O: atomic writes, JSON with one-line errors, safetensors read without torch or pickle."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import stat
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from minigpt.common.strict_json import JsonError, checked_shape, parse_json, preview
from minigpt.errors import MinigptError

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100_000_000  # a safetensors header past this is damage, not a model
MAX_JSON_BYTES = 256 * 2**20  # config, tokenizer and metrics files; o200k's tokenizer.json is about 5 MB


def regular_file(path: Path, what: str = "") -> Path:
    """`path`, checked to be a regular file (following links): a FIFO, device or folder would block a
    read, never end, or mean something else; each is a one-line error naming it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise MinigptError(f"{path} is missing{what and ': ' + what}") from None
    except OSError as e:
        raise MinigptError(f"cannot read {path} ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"
        raise MinigptError(f"{path} is {kind}: expected a file")
    return path


def json_safe(obj: Any) -> Any:
    """`obj` with NaN and infinities as None, so what minigpt writes is strict JSON (null, not NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = None) -> str:
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def _fsync_dir(directory: Path) -> None:
    # the rename itself must reach the disk, or a power cut can undo it
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dir(path: Path) -> Path:
    """Create a folder (and its parents) or say in one line why it cannot be."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MinigptError(f"cannot create the folder {path} ({e.strerror or e})") from None
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it, so set it straight back
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_paths(*paths: Path) -> Iterator[list[Path]]:
    """Yield a temp path beside each of `paths`; on success fsync them all, then rename each over its path,
    one right after the other.

    A crash or Ctrl-C at any moment leaves each file old or new, never a mix; files written together (the
    weights and the config.json describing them) land together, but for a crash between two renames.
    """
    paths = tuple(map(Path, paths))
    temps: list[Path] = []
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            temps.append(Path(tmp_name))
        yield temps
        for tmp in temps:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would make run files private
        with _signals_held():
            for tmp, path in zip(temps, paths, strict=True):
                os.replace(tmp, path)  # replaces a symlink itself, never writes through it
        for directory in {path.parent for path in paths}:
            _fsync_dir(directory)
    except OSError as e:  # disk full, read-only, no permission: the files being replaced are untouched
        names = ", ".join(path.name for path in paths)
        raise MinigptError(
            f"cannot write {', '.join(map(str, paths))} ({e.strerror or e}); the previous {names}, if any, "
            f"{'is' if len(paths) == 1 else 'are'} intact"
        ) from None
    finally:
        for tmp in temps:
            if tmp.exists():
                tmp.unlink()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then are handled as they would have been: a Ctrl-C
    cannot land between the renames of files that belong together. Python runs signal handlers in the main
    thread whichever thread the signal reached, so the handlers are swapped for a recorder there (a mask
    would hold the signal back from this thread only); elsewhere a handler cannot interrupt this thread."""
    names = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, names):
        yield  # None: a handler not set from Python, which could not be put back
        return
    caught: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in names}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum in caught:
            signal.raise_signal(signum)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync it and rename it over `path`."""
    with atomic_paths(path) as (tmp,):
        yield tmp


def remove_stale_temps(directory: Path) -> None:
    """Delete temp files a killed writer left behind (the files they were replacing are intact)."""
    for tmp in Path(directory).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def json_bytes(obj: Any) -> bytes:
    """The bytes minigpt writes a JSON file as: strict JSON, indented, UTF-8, a final newline."""
    return (to_json(obj, indent=2) + "\n").encode("utf-8")


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO]:
    """A regular file opened for reading, checked on the file actually opened (non-blocking, so a FIFO
    swapped in after a look cannot hang us): anything else is a one-line MinigptError."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MinigptError(f"cannot read {path} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MinigptError(f"{path} is not a regular file (a FIFO, device or socket): expected a file")
        os.set_blocking(fd, True)
        yield f


def read_bounded(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """A regular file's bytes, refusing one larger than `limit`. The checks apply to the file actually
    opened (non-blocking, so a FIFO swapped in after a look cannot hang us), and at most limit + 1 bytes
    are read whatever the file grows to."""
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise MinigptError(f"cannot read {path} ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MinigptError(f"{path} is not a regular file (a FIFO, device or socket): expected a file")
        if info.st_size > limit:
            raise MinigptError(
                f"{path} is {info.st_size:,} bytes, more than the {limit:,} a minigpt file can be"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise MinigptError(f"cannot read {path} ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise MinigptError(f"{path} grew past the {limit:,} bytes a minigpt file can be while it was read")
    return data


def read_json(path: Path) -> Any:
    """A JSON file's content, read strictly (`parse_json`); unreadable, oversized or malformed JSON is a
    one-line MinigptError."""
    try:
        return parse_json(read_bounded(path))
    except JsonError as e:
        raise MinigptError(f"{path} is corrupt ({str(e)[:200]}): restore it from a good copy") from None


def write_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors as safetensors to `path` as it is: for a temp path from atomic_paths."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors as safetensors, atomically."""
    with atomic_path(path) as tmp:
        write_tensors(tmp, tensors, metadata)


def load_tensors(path: Path, framework: Literal["pt", "np"] = "pt") -> tuple[dict[str, Any], dict[str, str]]:
    """A safetensors file's tensors (torch, or NumPy without importing torch) and metadata; a missing or
    damaged file is a one-line MinigptError."""
    from safetensors import safe_open

    path = regular_file(path, "is this a complete minigpt run directory?")
    try:
        with safe_open(str(path), framework=framework) as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a mapping)
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise MinigptError(
            f"{path} is corrupt or not a safetensors file ({e}); retrain or restore it"
        ) from None
    return tensors, metadata


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor's entry in a safetensors header ('dtype', 'shape', ...), without torch or the data."""
    return _read_header(path)[0]


def safetensors_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata (its header's string map), without torch or the data."""
    return _read_header(path)[1]


def _read_header(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    path = regular_file(path, "is this a complete minigpt run directory?")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = parse_json(f.read(n))
        metadata = header.get("__metadata__") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("metadata is not a map of strings")
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, v in entries.items():
            v["dtype"] = str(v["dtype"])
            v["shape"] = checked_shape(v["shape"], f"the shape of {preview(name)}")
        return entries, metadata
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise MinigptError(
            f"{path} is corrupt or not a safetensors file ({e}); restore it from a good copy"
        ) from None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header, without torch and without reading the data."""
    return {k: v["shape"] for k, v in safetensors_header(path).items()}
