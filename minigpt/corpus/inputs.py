"""Which files a corpus is made of: formats by name, folders walked, and each file known by a cheap stamp.

Nothing here reads a whole file: a corpus of any size is found and stamped in the time it takes to list it.
A file's stamp is its size, its modification time and a fingerprint (sha256 of its size and of sampled
blocks: its first and last FINGERPRINT_EDGE bytes and FINGERPRINT_BLOCKS blocks spread between). The token
store and the tokenizer cache are keyed by stamps; a file's full sha256 is computed once its tokens are
written (minigpt.corpus.ingest) and is what a resume compares when a file's modification time changed.
A file is stamped again before each chunk of its tokens lands and once it is read (`changes`): with its
inode and change time, which any write moves and nothing sets back, so a file rewritten while it is read,
even restored afterwards with its old modification time, never has its tokens filed under its stamp.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.errors import MinigptError

READ_BYTES = 4 << 20  # bytes read (and hashed, decoded) at a time
SNIFF_BYTES = 8192  # a NUL byte this early in a plain text file means a binary file, as git decides
FINGERPRINT_EDGE = 16 << 10  # bytes fingerprinted at each end of a file
FINGERPRINT_BLOCKS = 8  # further blocks of FINGERPRINT_BLOCK bytes, evenly spaced between the ends
FINGERPRINT_BLOCK = 4 << 10
FORMATS = {".txt": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
KNOWN = (
    "text (.txt), JSON lines (.jsonl, .ndjson) and Parquet (.parquet), each also as .gz, .zst, .bz2 or .xz"
)


@dataclass(frozen=True)
class Source:
    """One input file: where it is, how it is stored, and its stamp (size, mtime, sampled content)."""

    path: Path
    size: int  # bytes on disk
    mtime_ns: int
    fingerprint: str  # sha256 of the size and sampled blocks
    format: str  # text, jsonl or parquet
    compression: str | None  # gzip, zstd, bz2, xz or None
    inode: int = 0  # with the change time, what any write moves (never part of the stamp: a copy differs)
    ctime_ns: int = 0

    @property
    def stamp(self) -> dict[str, Any]:
        """What keys this file's tokens: its content as sampled, its size and modification time."""
        return {"size": self.size, "mtime_ns": self.mtime_ns, "fingerprint": self.fingerprint}


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
    """The files given and those under the folders given (recursively, hidden ones left out, sorted by
    name), each once, in the order given: the corpus order, whose end is held out for validation."""
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


def stamp_source(path: Path, encoding: str) -> Source:
    """The file's Source: stamped from a few sampled blocks, refused when empty or (plain text) binary."""
    fmt, compression = file_kind(path, explicit=True) or ("text", None)
    sniff = fmt == "text" and compression is None and ascii_compatible(encoding)
    try:
        st, fingerprint = _fingerprint(path, sniff)
    except OSError as e:
        raise MinigptError(f"cannot read {path}: {e.strerror}") from None
    if st.st_size == 0:
        raise MinigptError(f"{path} is empty: there is no text in it")
    return Source(path, st.st_size, st.st_mtime_ns, fingerprint, fmt, compression, st.st_ino, st.st_ctime_ns)


def _fingerprint(path: Path, sniff: bool) -> tuple[os.stat_result, str]:
    """The file's status and fingerprint, read through one open (`sniff`: a NUL byte early on is an error)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        h = hashlib.sha256(st.st_size.to_bytes(8, "little"))
        for offset, size in fingerprint_blocks(st.st_size):
            f.seek(offset)
            block = f.read(size)
            if offset == 0 and sniff and b"\x00" in block[:SNIFF_BYTES]:
                raise binary_error(path)
            h.update(block)
    return st, h.hexdigest()


def changes(src: Source) -> str | None:
    """How the file differs now from `src`, its stamp, in words; None if it does not."""
    try:
        st, fingerprint = _fingerprint(src.path, sniff=False)
    except OSError:
        return "it is gone or unreadable"
    if st.st_size != src.size:
        return f"its size went from {src.size:,} to {st.st_size:,} bytes"
    if fingerprint != src.fingerprint:
        return "its sampled content differs"
    if st.st_mtime_ns != src.mtime_ns:
        return "its modification time moved"
    if (st.st_ino, st.st_ctime_ns) != (src.inode, src.ctime_ns):
        return "its inode or change time moved: it was replaced, written to, or its permissions changed"
    return None


def fingerprint_blocks(size: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the blocks a file of `size` bytes is fingerprinted by: all of a small file."""
    if size <= 2 * FINGERPRINT_EDGE + FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
        return [(0, size)]
    inner = size - 2 * FINGERPRINT_EDGE - FINGERPRINT_BLOCK
    middle = [
        (FINGERPRINT_EDGE + inner * (i + 1) // (FINGERPRINT_BLOCKS + 1), FINGERPRINT_BLOCK)
        for i in range(FINGERPRINT_BLOCKS)
    ]
    return [(0, FINGERPRINT_EDGE), *middle, (size - FINGERPRINT_EDGE, FINGERPRINT_EDGE)]


def stamp_sources(
    files: list[Path], encoding: str, advance: Callable[[int], None], threads: int
) -> list[Source]:
    """stamp_source of each file, `threads` files at a time, in the files' order; `advance` hears each
    file's size as it is done."""

    def one(f: Path) -> Source:
        src = stamp_source(f, encoding)
        advance(src.size)
        return src

    if threads <= 1 or len(files) <= 1:
        return [one(f) for f in files]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, files))


def file_sha256(path: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    """The sha256 of a file's bytes (hashlib releases the GIL on large blocks)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                h.update(block)
                advance(len(block))
    except OSError as e:
        raise MinigptError(f"cannot read {path}: {e.strerror}") from None
    return h.hexdigest()
