"""Which files a corpus is made of: formats by name, folders walked, and each file hashed by content."""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import MinigptError

READ_BYTES = 4 << 20  # bytes read (and hashed, decoded) at a time
SNIFF_BYTES = 8192  # a NUL byte this early in a plain text file means a binary file, as git decides
FORMATS = {".txt": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
KNOWN = (
    "text (.txt), JSON lines (.jsonl, .ndjson) and Parquet (.parquet), each also as .gz, .zst, .bz2 or .xz"
)


@dataclass(frozen=True)
class Source:
    """One input file: where it is, how it is stored, and what it holds (sha256 of its bytes on disk)."""

    path: Path
    size: int  # bytes on disk
    digest: str
    format: str  # text, jsonl or parquet
    compression: str | None  # gzip, zstd, bz2, xz or None


def file_kind(path: Path, explicit: bool) -> tuple[str, str | None] | None:
    """(format, compression) from a file's name; a file named on the command line with another suffix is
    plain text (a folder walk skips it: None)."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    rest = suffixes[:-1] if compression else suffixes
    fmt = FORMATS.get(rest[-1]) if rest else None
    if fmt is None:
        return ("text", compression) if explicit else None
    return fmt, compression


def collect_files(paths: Iterable[Path]) -> list[Path]:
    """The files given and those under the folders given (recursively, hidden ones left out), each once."""
    files: list[Path] = []
    for p in paths:
        try:
            files.extend(_files_at(Path(p)))
        except OSError as e:  # e.g. a name too long for the filesystem
            raise MinigptError(f"cannot access {p}: {e.strerror}") from None
    unique: dict[Path, Path] = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def _files_at(p: Path) -> list[Path]:
    if p.is_dir():
        found = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
            and file_kind(f, explicit=False) is not None
        )
        if not found:
            raise MinigptError(f"{p} is a directory with no corpus files; minigpt reads {KNOWN}")
        return found
    if p.is_file():
        return [p]
    if p.exists():
        raise MinigptError(f"{p} is not a regular file; pass files or directories of {KNOWN}")
    raise MinigptError(f"{p}: no such file or directory")


def ascii_compatible(encoding: str) -> bool:
    return not codecs.lookup(encoding).name.startswith(("utf-16", "utf-32"))


def binary_error(path: Path) -> MinigptError:
    return MinigptError(f"{path} looks like a binary file (it contains NUL bytes); minigpt trains on {KNOWN}")


def hash_source(path: Path, encoding: str, advance: Callable[[int], None]) -> Source:
    """The file's Source: hashed by content, refused when empty or (plain text) binary."""
    fmt, compression = file_kind(path, explicit=True) or ("text", None)
    sniff = fmt == "text" and compression is None and ascii_compatible(encoding)
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                if size == 0 and sniff and b"\x00" in block[:SNIFF_BYTES]:
                    raise binary_error(path)
                h.update(block)  # hashlib releases the GIL on large blocks: files hash in parallel
                size += len(block)
                advance(len(block))
    except OSError as e:
        raise MinigptError(f"cannot read {path}: {e.strerror}") from None
    if size == 0:
        raise MinigptError(f"{path} is empty: there is no text in it")
    return Source(path, size, h.hexdigest(), fmt, compression)


def hash_sources(
    files: list[Path], encoding: str, advance: Callable[[int], None], threads: int
) -> list[Source]:
    """hash_source of each file, `threads` files at a time, in the files' order."""
    if threads <= 1 or len(files) <= 1:
        return [hash_source(f, encoding, advance) for f in files]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda f: hash_source(f, encoding, advance), files))
