"""The token store: token ids on disk, one entry per (input file or span of it, tokenizer, reading
settings), in chunks.

Layout, under <cache>/tokens/<entry key>/:

    chunk-000000.bin    the chunk's token ids, raw uint16 (vocabularies up to 65,536) or uint32
    chunk-000000.json   tokens, text bytes, a CRC-32 of the .bin and its stamp (inode, size, mtime, ctime)
                        once checked: written last, so a chunk whose .json is there is complete
    done.json           written after the last chunk: the entry's chunk count and totals

An entry key hashes the file's stamp (size, modification time, sampled content: minigpt.corpus.inputs), the
span, the tokenizer and every setting that shapes the documents, so the same file in another folder (moved,
or copied with its modification time) finds its tokens, and changing any of them writes a new entry.
Chunks land one at a time by atomic renames: a reader sees whole chunks or none, concurrent writers (torchrun
ranks) write identical bytes, and an entry interrupted half-way keeps its finished chunks for the next run.
Entries are never evicted.

Nothing in a store is trusted. An entry's done.json must match the chunk files its folder lists (count and
sizes) before any chunk is read. A chunk's .json is checked field by field, its ids at most
MAX_CHUNK_TOKENS, and its .bin must be a regular file of the size it says. Its CRC-32 and every id's range
are checked once, so that check reads at most the largest chunk minigpt writes: the .json then records the
.bin's stamp, and a later run checks again only a .bin whose stamp differs (any write to it changes its
ctime, which no one can set back), so a warm start reads no tokens. Ids are checked once more as they are
used (minigpt.corpus.streams), so even a .json forged to match cannot bring an id past the vocabulary.

<cache>/files/<stamp key>.json records the sha256 of a file's bytes, hashed once its tokens are written: a
resume compares it when a file's modification time changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.common.files import read_bounded
from minigpt.common.strict_json import parse_json
from minigpt.corpus.readers import ReadStats
from minigpt.corpus.spool import host, temp_path
from minigpt.errors import MinigptError

STORE_FORMAT = 3  # bump when the token stream of the same file and tokenizer would change
MAX_META_BYTES = 1 << 20  # a chunk's JSON is a few hundred bytes
CHECK_BYTES = 16 << 20  # bytes checksummed and range-checked at a time
# ids one chunk may hold: a chunk closes at the first job (at most 1M characters) past 64M characters
# (minigpt.corpus.encode), and no tokenizer gives 8 ids a character; a chunk claiming more is not one minigpt
# wrote, and checking it would read without bound (a sparse file claims terabytes, and its size agrees)
MAX_CHUNK_TOKENS = 8 * (65 << 20)
_CHUNK_BIN = re.compile(r"chunk-(\d{6,})\.bin")
# the temp files writers leave while writing: .<final name>.<pid>@<host>.tmp
_TEMP_NAME = re.compile(r"\..+\.(?P<pid>\d{1,9})@(?P<host>[^@/]*)\.tmp")


def content_key(obj: Any) -> str:
    """A short hash of a JSON-able description: the name of a cache entry."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True)
class Chunk:
    """A finished chunk of an entry."""

    bin_path: Path
    tokens: int
    text_bytes: int

    def ids(self, dtype: np.dtype) -> ChunkIds:
        """The chunk's ids, read from disk a slice at a time."""
        return ChunkIds(self.bin_path, np.dtype(dtype), self.tokens)


class ChunkIds:
    """A chunk's ids as a read-only array that reads each slice from the file when it is taken.

    Reads, not a memory map: pages a process maps count in its resident memory, and random training
    windows over a memory-mapped store of gigabytes would touch most of them and count them in the train
    command's resident memory, far above its heap; read with pread, the same pages stay in the kernel's
    page cache only.
    """

    def __init__(self, path: Path, dtype: np.dtype, tokens: int) -> None:
        self.path, self.dtype, self.tokens = path, dtype, tokens

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(self.tokens)
        if step != 1:
            raise TypeError("chunk ids are read by contiguous slices")
        out = np.empty(max(stop - start, 0), dtype=self.dtype)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(out).cast("B")], start * self.dtype.itemsize) if len(out) else 0
        finally:
            os.close(fd)
        if got != out.nbytes:
            raise MinigptError(
                f"{self.path} ended early (its JSON promised {self.tokens:,} tokens): the token store is "
                f"damaged; delete {self.path.parent} and run again"
            )
        return out


class Entry:
    """One file's tokens in the store: its finished chunks, read and written."""

    def __init__(self, root: Path, key: str, vocab_size: int) -> None:
        self.dir = root / key
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self._made = False  # the folder made by this process (a folder of tiny files is a folder a file)

    def chunk_path(self, index: int, suffix: str) -> Path:
        return self.dir / f"chunk-{index:06d}{suffix}"

    def chunk(self, index: int, verify: bool) -> Chunk | None:
        """Chunk `index` if it is there and whole, else None. With `verify`, its checksum and ids are
        checked too, unless they were for this very file (its stamp unchanged since)."""
        meta_path, bin_path = self.chunk_path(index, ".json"), self.chunk_path(index, ".bin")
        try:
            if not meta_path.is_file():
                return None
            meta = parse_json(read_bounded(meta_path, MAX_META_BYTES))
            if not self._meta_fits(meta, bin_path):
                return None
            if verify and meta.get("stamp") != file_stamp(bin_path):
                if _check(bin_path, self.dtype, self.vocab_size) != meta["crc32"]:
                    return None
                with contextlib.suppress(OSError):  # a read-only store is checked again next time
                    _land(meta_path, json.dumps({**meta, "stamp": file_stamp(bin_path)}).encode())
        except (OSError, MinigptError, ValueError, RecursionError):  # unreadable, not JSON, absurdly nested
            return None
        return Chunk(bin_path, meta["tokens"], meta["text_bytes"])

    def _meta_fits(self, meta: Any, bin_path: Path) -> bool:
        """Every field there and well typed, and the .bin a regular file of the size the meta says."""
        if not isinstance(meta, dict):
            return False
        counts = [meta.get(k) for k in ("tokens", "text_bytes", "crc32")]
        return (
            meta.get("format") == STORE_FORMAT
            and meta.get("dtype") == self.dtype.name
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
            and 0 < meta["tokens"] <= MAX_CHUNK_TOKENS
            and bin_path.is_file()  # never open a FIFO planted in the store
            and bin_path.stat().st_size == meta["tokens"] * self.dtype.itemsize
        )

    def done(self) -> dict[str, Any] | None:
        """done.json if the entry is complete, else None."""
        try:
            meta = parse_json(read_bounded(self.dir / "done.json", MAX_META_BYTES))
        except (OSError, MinigptError, ValueError, RecursionError):
            return None
        fields = ("chunks", "tokens", "text_bytes", "documents", "skipped")
        ok = isinstance(meta, dict) and meta.get("format") == STORE_FORMAT
        ok = ok and all(isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) for k in fields)
        return meta if ok and meta["chunks"] >= 0 and isinstance(meta.get("nonblank"), bool) else None

    def holds(self, done: dict[str, Any]) -> bool:
        """Whether the entry's folder holds the chunk files done.json counts, and their ids add up to the
        tokens it says: a listing, no file read, before any chunk is checked."""
        count = size = 0
        try:
            with os.scandir(self.dir) as found:
                for item in found:
                    m = _CHUNK_BIN.fullmatch(item.name)
                    if m is None:
                        continue
                    if int(m[1]) >= done["chunks"] or not item.is_file():
                        return False
                    count, size = count + 1, size + item.stat().st_size
        except OSError:
            return False
        return count == done["chunks"] and size == done["tokens"] * self.dtype.itemsize

    def write_chunk(self, index: int, ids: np.ndarray, text_bytes: int) -> Chunk:
        """Land one chunk: its .bin by temp file and rename, then its .json (with the .bin's stamp)."""
        self._make_dir()
        bin_path = self.chunk_path(index, ".bin")
        ids = ids.astype(self.dtype, copy=False)
        _land(bin_path, ids.tobytes())
        meta = {
            "format": STORE_FORMAT,
            "dtype": self.dtype.name,
            "tokens": len(ids),
            "text_bytes": text_bytes,
            "crc32": zlib.crc32(ids.data),
            "stamp": file_stamp(bin_path),
        }
        _land(self.chunk_path(index, ".json"), json.dumps(meta).encode())
        return Chunk(bin_path, len(ids), text_bytes)

    def finish(self, chunks: list[Chunk], stats: ReadStats) -> None:
        meta = {
            "format": STORE_FORMAT,
            "chunks": len(chunks),
            "tokens": sum(c.tokens for c in chunks),
            "text_bytes": sum(c.text_bytes for c in chunks),
            "documents": stats.documents,
            "nonblank": stats.nonblank,
            "skipped": stats.skipped,
            "first_skipped": stats.first_skipped[:500],
        }
        self._make_dir()  # an empty span has no chunks
        _land(self.dir / "done.json", json.dumps(meta).encode())

    def _make_dir(self) -> None:
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made = True


def file_stamp(path: Path) -> list[int]:
    """What changes whenever a file's bytes do: inode, size, modification and change times."""
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _check(path: Path, dtype: np.dtype, bound: int) -> int | None:
    """CRC-32 of a file of ids, or None if an id is not below `bound` (one pass, bounded memory)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHECK_BYTES):
            ids = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
            if len(ids) and int(ids.max()) >= bound:
                return None
            crc = zlib.crc32(block, crc)
    return crc


def _land(final: Path, data: bytes) -> None:
    tmp = temp_path(final)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, final)  # atomic; concurrent writers of identical bytes: the last one wins
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def remove_stale_temps(directory: Path) -> None:
    """Delete the temp files of writers on this machine that were killed (kill -9, or SIGTERM while
    tokenizing). A file whose writer process is alive is never touched, nor one from another machine
    sharing the cache (an NFS home under multi-node torchrun), whose process table we cannot see.
    """
    with contextlib.suppress(OSError):
        for tmp in directory.glob("**/.*.tmp"):
            m = _TEMP_NAME.fullmatch(tmp.name)
            if m and m["host"] == host() and not _process_alive(int(m["pid"])):
                with contextlib.suppress(OSError):
                    tmp.unlink()


def _process_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows: assume alive, keep the file
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


class FileHashes:
    """sha256 of input files by their stamps: <cache>/files/<stamp key>.json."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, stamp: dict[str, Any]) -> Path:
        return self.root / f"{content_key(stamp)}.json"

    def get(self, stamp: dict[str, Any]) -> str | None:
        try:
            data = parse_json(read_bounded(self.path(stamp), MAX_META_BYTES))
        except (OSError, MinigptError, ValueError, RecursionError):
            return None
        found = data.get("sha256") if isinstance(data, dict) else None
        return found if isinstance(found, str) and re.fullmatch(r"[0-9a-f]{64}", found) else None

    def put(self, stamp: dict[str, Any], sha256: str) -> None:
        write_json_atomic(self.path(stamp), {"sha256": sha256})


def write_json_atomic(final: Path, obj: Any) -> None:
    """A small JSON file landed by temp file and rename (tokenizers in the cache)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _land(final, (json.dumps(obj) + "\n").encode("utf-8"))
