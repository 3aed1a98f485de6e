"""The validation split: the end of the corpus, held out, and tokenized before the rest.

Validation is the last --val-fraction of the corpus in the order its files are given (a folder's files by
name), measured in bytes on disk, and at most VAL_MAX_BYTES of document bytes: whole files taken from the
end. Where whole files would hold less than half of it because the next file back is large (a corpus of
one or a few big files), the cut falls inside that file: at a line (a document) of JSON lines, a row of
Parquet, and in a text file (one document) at the character where the held-out bytes begin:
tinyshakespeare's validation text is its last 10%, as it has always been. Cuts inside files are kept to
that case because a file cut in two is stored as two spans (minigpt.corpus.store), and a cut that moves
(the corpus grew) tokenizes that file again; whole files keep their tokens whichever role they play. For BPE tokenizers the cut then moves on to where the split pattern starts a new piece anyway
(within ALIGN_BYTES), so the two halves tokenize as the whole file does. Within the file where the cut
falls, the fraction applies to its decompressed bytes (Parquet: its text column's size in its metadata).

Finding the cut reads the end of a plain file (a seek), the last row groups of a Parquet file, and all of a
compressed file at the end of the corpus (decompressed through once). The parts are cached by the files'
stamps, so a second run on the same corpus reads nothing.
"""

from __future__ import annotations

import codecs
import collections
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.common.files import read_json
from minigpt.corpus.inputs import Source
from minigpt.corpus.readers import (
    OPENERS,
    WHOLE,
    Position,
    ReadOptions,
    Span,
    byte_blocks,
    group_rows,
    open_parquet,
    parquet_batches,
    seekable_encoding,
)
from minigpt.corpus.store import content_key, write_json_atomic
from minigpt.errors import MinigptError

VAL_MAX_BYTES = 32 << 20  # document bytes held out at most, whatever --val-fraction says
ALIGN_BYTES = 64 << 10  # how far a cut inside a text file may move to a point where a new piece starts
SPLIT_FORMAT = 2  # bump when the same corpus and settings would be split differently
# where every split pattern we use starts a new pre-token whatever comes before or after: at a space between
# letters (the left side ends in a run of letters, the right starts with " letters"). Not after whitespace:
# `\s+(?!\S)` keeps "\n\n" whole only at the end of a text, so a cut after a newline changes its tokens
# (ASCII bytes are those characters in UTF-8 and the one-byte encodings)
_PIECE_START = re.compile(rb"(?<=[A-Za-z]) (?=[A-Za-z])")


@dataclass(frozen=True)
class Part:
    """A file, or the span of it, that is validation or training text."""

    source: int  # index in the corpus order
    span: Span
    role: str  # validation or training


def plan_split(
    sources: Sequence[Source],
    fraction: float,
    opts: ReadOptions,
    align: bool,
    cache: Path,
    advance: Callable[[int], None],
) -> list[Part]:
    """The validation parts (in corpus order), then the training parts (in corpus order). `align`: move a
    cut inside a text file to where a BPE split pattern starts a new piece. Cached under `cache`."""
    key = content_key(
        {
            "format": SPLIT_FORMAT,
            "fraction": fraction,
            "max_bytes": VAL_MAX_BYTES,
            "align": align,
            "read": [opts.key(s.format) for s in sources],
            "files": [[s.stamp, s.format, s.compression] for s in sources],
        }
    )
    path = cache / f"{key}.json"
    parts = _load(path, len(sources))
    if parts is None:
        parts = _plan(sources, fraction, opts, align, advance)
        write_json_atomic(path, [[p.source, p.span.start, p.span.stop, p.role] for p in parts])
    return parts


def _load(path: Path, n: int) -> list[Part] | None:
    """A cached split, checked to be one (anything else is planned again)."""
    try:
        rows = read_json(path) if path.is_file() else None
    except MinigptError:
        return None
    if not isinstance(rows, list):
        return None
    parts = []
    for row in rows:
        ok = isinstance(row, list) and len(row) == 4 and row[3] in ("validation", "training")
        ok = ok and _is_index(row[0], n) and all(x is None or _is_index(x, 1 << 62) for x in row[1:3])
        if not ok:
            return None
        parts.append(Part(row[0], Span(row[1], row[2]), row[3]))
    return parts if any(p.role == "validation" for p in parts) else None


def _is_index(x: Any, n: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n


def _plan(
    sources: Sequence[Source], fraction: float, opts: ReadOptions, align: bool, advance: Callable[[int], None]
) -> list[Part]:
    want = max(1, round(sum(s.size for s in sources) * fraction))
    held, raw = 0, 0  # bytes on disk and document bytes held out so far
    whole: list[int] = []  # files held out whole, last first
    cut: tuple[int, int] | None = None  # (file, position) where validation starts inside a file
    for i in reversed(range(len(sources))):
        src = sources[i]
        need, room = want - held, VAL_MAX_BYTES - raw
        if need <= 0 or room <= 0:
            break
        tail = _tail(src, opts, room, advance)
        fits = tail.whole(room) if src.size <= need else None
        if fits is not None:
            whole.append(i)
            held, raw = held + src.size, raw + fits
            continue
        budget = min(room, max(1, round(tail.size * need / src.size)))
        at = tail.cut(budget, inside=raw < budget, align=align, encoding=opts.encoding)
        if at == 0:  # the last documents are the whole file
            whole.append(i)
        elif at is not None:
            cut = (i, at)
        break
    if not whole and cut is None:
        raise MinigptError(
            "the corpus is too small to hold out validation text; give more text or --val-file"
        )
    val = [Part(cut[0], Span(start=cut[1]), "validation")] if cut else []
    val += [Part(i, WHOLE, "validation") for i in reversed(whole)]
    held = set(whole)  # a folder of tiny files holds out thousands whole: no list to search for each file
    train = [
        Part(i, Span(stop=cut[1]) if cut and cut[0] == i else WHOLE, "training")
        for i in range(len(sources))
        if i not in held
    ]
    return val + train


class _Tail:
    """The end of a text or JSON lines file: its (decompressed) size, and its last bytes where needed."""

    def __init__(self, src: Source, size: int, window: bytes | None, lo: int) -> None:
        self.src, self.size = src, size
        self._window, self.lo = window, lo  # bytes [lo, size), read on demand from a plain file

    def whole(self, room: int) -> int | None:
        """The file's document bytes if they fit in `room`."""
        return self.size if self.size <= room else None

    @property
    def window(self) -> bytes:
        if self._window is None:
            with open(self.src.path, "rb") as f:
                f.seek(self.lo)
                self._window = f.read(self.size - self.lo)
        return self._window

    def cut(self, budget: int, inside: bool, align: bool, encoding: str) -> int | None:
        """Where the last `budget` bytes begin: at a line (a document) in JSON lines, inside a text file
        (its one document). None: nothing of this file is held out (not `inside`: the whole files after
        it hold enough)."""
        if not inside:
            return None
        start = self.size - budget
        if self.src.format == "jsonl":
            return self._line_at(start)
        if not seekable_encoding(encoding):
            return start  # read from the file's start, so any byte will do
        data = self.window[start - self.lo : start - self.lo + ALIGN_BYTES]
        skip = _char_start(data, encoding)
        if align and (m := _PIECE_START.search(data, skip)):
            skip = m.start()
        return start + skip

    def _line_at(self, start: int) -> int | None:
        """The first line at or after `start` if the rest holds text, else the last line with text (None:
        it began before the window: a line longer than the validation text may be)."""
        data, lo = self.window, self.lo
        newline = data.find(b"\n", max(start - 1 - lo, 0))
        at = newline + 1 + lo if newline >= 0 else self.size
        if data[at - lo :].strip():
            return at
        body = data.rstrip()
        last = body.rfind(b"\n") + 1
        return lo + last if body and (last or lo == 0) else None


def _char_start(data: bytes, encoding: str) -> int:
    """Bytes before the first character's start: UTF-8 continuation bytes (10xxxxxx); 0 in one-byte codecs."""
    if codecs.lookup(encoding).name not in ("utf-8", "utf-8-sig"):
        return 0
    i = 0
    while i < len(data) and 0x80 <= data[i] < 0xC0:
        i += 1
    return i


def _tail(src: Source, opts: ReadOptions, room: int, advance: Callable[[int], None]) -> Any:
    if src.format == "parquet":
        return _ParquetTail(src, opts)
    window = room + 16  # the cut's line break, or a character's first bytes, may sit just before it
    if src.compression is None:
        return _Tail(src, src.size, None, max(0, src.size - window))
    return _scan_compressed(src, window, advance)


def _scan_compressed(src: Source, window: int, advance: Callable[[int], None]) -> _Tail:
    """A compressed file decompressed through once: its size, and its last `window` bytes."""
    kept: collections.deque[bytes] = collections.deque()
    kept_bytes = size = 0
    with open(src.path, "rb") as raw:
        stream = OPENERS[str(src.compression)](raw)
        for block in byte_blocks(src, stream, Position(raw, advance)):
            size += len(block)
            kept.append(block)
            kept_bytes += len(block)
            while kept_bytes - len(kept[0]) >= window:
                kept_bytes -= len(kept.popleft())
    data = b"".join(kept)[-window:]
    return _Tail(src, size, data, size - len(data))


class _ParquetTail:
    """The end of a Parquet file: rows from the last, by their text's bytes."""

    def __init__(self, src: Source, opts: ReadOptions) -> None:
        self.src, self.opts = src, opts
        with open_parquet(src, opts) as (pf, column):
            index = pf.schema_arrow.get_field_index(column)
            meta = pf.metadata
            self.size = sum(  # the text column's size in the metadata: what the fraction applies to
                meta.row_group(g).column(index).total_uncompressed_size for g in range(pf.num_row_groups)
            )
            self.rows = meta.num_rows

    def whole(self, room: int) -> int | None:
        """The text bytes of all rows if they fit in `room`."""
        taken, row = self._from_end(room)
        return taken if row == 0 else None

    def cut(self, budget: int, inside: bool, align: bool, encoding: str) -> int | None:
        """The first of the last rows whose text holds at most `budget` bytes (at least one row); None when
        not `inside` (the whole files after it hold enough)."""
        if not inside:
            return None
        taken, row = self._from_end(budget)
        return row if row < self.rows else (self.rows - 1 if self.rows else None)

    def _from_end(self, budget: int) -> tuple[int, int]:
        """(bytes, first row) of the most rows from the end whose text holds at most `budget` bytes."""
        import pyarrow.compute as pc

        taken, row = 0, self.rows
        with open_parquet(self.src, self.opts) as (pf, column):
            for first, n in reversed(group_rows(pf)):
                lengths: list[int] = []
                for batch in parquet_batches(self.src, pf, column, first, first + n):
                    lengths += pc.fill_null(pc.binary_length(batch.column(0)), 0).to_pylist()
                for length in reversed(lengths):
                    if taken + length > budget:
                        return taken, row
                    taken, row = taken + length, row - 1
        return taken, row
