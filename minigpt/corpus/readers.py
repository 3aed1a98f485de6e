"""Documents out of corpus files: plain text, JSON lines and Parquet, each plain or compressed.

A reader yields a document as one or more text pieces followed by None (the document's end). It reads a
whole file or a Span of it (the validation split holds out a file's end): positions are bytes of the
(decompressed) stream for text and JSON lines, rows for Parquet. A span that stops inside a text file's one
document yields its text without the end (the rest of the document is the next span's). Every bad input is
a one-line MinigptError naming the file and, where there is one, the line or row.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import lzma
import re
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from minigpt.common.strict_json import JsonError, parse_json
from minigpt.corpus.inputs import READ_BYTES, Source, binary_error
from minigpt.corpus.progress import text_size
from minigpt.corpus.spool import SPOOL_FLOOR, SPOOL_RATIO, spool_cap, spooled
from minigpt.errors import MinigptError

try:  # Python 3.14's standard library; the backport before it
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd  # type: ignore[no-redef]

MAX_RECORD_BYTES = 64 << 20  # one JSON line or Parquet value; a larger one is damage or not a document
PARQUET_BATCH_ROWS = 4096  # rows decoded at a time: one row group is never held whole
PARQUET_EXTRA = "pip install 'minigpt[parquet]'"
# Python's UTF decoders never yield a lone surrogate; others can (utf-7, unicode_escape, punycode), and
# JSON can spell one (\ud800), so only such text is searched for one (a search is a pass over the text)
_SURROGATE_FREE_CODECS = ("utf-8", "utf-16", "utf-32", "ascii", "iso8859-1")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
OPENERS: dict[str, Callable[[IO[bytes]], IO[bytes]]] = {
    "gzip": lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"),
    "bz2": lambda raw: bz2.BZ2File(raw, "rb"),
    "xz": lambda raw: lzma.LZMAFile(raw, "rb"),
    "zstd": lambda raw: zstd.ZstdFile(raw, "rb"),
}
CORRUPT = (OSError, EOFError, zlib.error, lzma.LZMAError, zstd.ZstdError, ValueError)

Piece = str | None  # text of the current document, or None where a document ends


@dataclass(frozen=True)
class ReadOptions:
    """How files are turned into documents (part of what the token store is keyed by)."""

    encoding: str = "utf-8"  # plain text files; JSON lines and Parquet are UTF-8 by their formats
    errors: str = "strict"  # strict, replace (U+FFFD) or ignore, for undecodable bytes and lone surrogates
    text_field: str = "text"  # the JSON field or Parquet column holding a document
    skip_bad: bool = False  # skip (and count) bad JSON lines and Parquet values instead of stopping
    spool: Path | None = None  # where a compressed Parquet file is decompressed to (a folder in the cache)

    def key(self, fmt: str) -> dict[str, Any]:
        """The settings that shape the documents of a file of this format."""
        if fmt == "text":
            return {"encoding": self.encoding, "errors": self.errors}
        return {"errors": self.errors, "field": self.text_field, "skip_bad": self.skip_bad}


@dataclass(frozen=True)
class Span:
    """The part of a file read: from `start` to `stop` (None: the file's start, its end)."""

    start: int | None = None
    stop: int | None = None

    @property
    def whole(self) -> bool:
        return self.start is None and self.stop is None

    def key(self) -> list[int | None]:
        return [self.start, self.stop]


WHOLE = Span()


@dataclass
class ReadStats:
    """What reading found besides documents: bad records skipped, with the first one in words, and
    whether there was any text (a file whose parts all hold none is refused once they are all read)."""

    skipped: int = 0
    first_skipped: str = ""
    documents: int = 0
    nonblank: bool = False

    def skip(self, where: str) -> None:
        self.skipped += 1
        self.first_skipped = self.first_skipped or where


@dataclass
class Position:
    """Raw (on-disk) bytes consumed so far, reported to `advance` as they grow (bytes skipped to reach a
    span's start are not: they are the previous span's)."""

    raw: IO[bytes]
    advance: Callable[[int], None]
    done: int = 0

    def update(self, report: bool = True) -> None:
        with contextlib.suppress(OSError, ValueError):
            now = self.raw.tell()
            if now > self.done and report:
                self.advance(now - self.done)
            self.done = max(self.done, now)

    def finish(self, end: int) -> None:
        if end > self.done:
            self.advance(end - self.done)
            self.done = end


def documents(
    src: Source,
    opts: ReadOptions,
    advance: Callable[[int], None],
    stats: ReadStats | None = None,
    span: Span = WHOLE,
) -> Iterator[Piece]:
    """The documents of one file (or of a span of it) as pieces, each document closed by None; `advance`
    hears the file's bytes as they are read."""
    stats = stats if stats is not None else ReadStats()
    if src.format == "parquet":
        yield from _parquet_documents(src, opts, advance, stats, span)
        return
    try:
        raw = open(src.path, "rb")  # noqa: SIM115 - closed below, after the generator is done with it
    except OSError as e:
        raise MinigptError(f"cannot read {src.path}: {e.strerror}") from None
    with raw:
        position = Position(raw, advance)
        stream = OPENERS[src.compression](raw) if src.compression else raw
        start = span.start or 0
        if src.format == "jsonl":
            blocks = byte_blocks(src, stream, position, start, span.stop)
            yield from _jsonl_documents(src, blocks, opts, stats, start, span.whole)
        else:
            # an encoding that cannot start mid-file is decoded from the start, its text shown from `start`
            seek = start if seekable_encoding(opts.encoding) else 0
            blocks = byte_blocks(src, stream, position, seek, span.stop)
            yield from _text_document(src, blocks, opts, stats, seek, start, span)
        position.finish(src.size if span.stop is None else position.done)


def byte_blocks(
    src: Source, stream: IO[bytes], position: Position, start: int = 0, stop: int | None = None
) -> Iterator[bytes]:
    """The file's (decompressed) bytes from `start` to `stop` block by block: a plain file seeks to its
    start, a compressed one is decompressed through; damage is one line naming the file."""
    done = 0
    if start and src.compression is None:
        stream.seek(start)
        done = start
        position.update(report=False)
    try:
        while stop is None or done < stop:
            want = READ_BYTES if stop is None else min(READ_BYTES, stop - done)
            if done < start:
                want = min(want, start - done)
            block = stream.read(want)
            position.update(report=done >= start)
            if not block:
                return
            done += len(block)
            if done - len(block) >= start:  # reads stop at `start` while skipping: no block straddles it
                yield block
    except CORRUPT as e:
        raise damaged(src, e) from None


def seekable_encoding(encoding: str) -> bool:
    """Whether a text in this encoding can be decoded from any character's first byte: UTF-8 (a character
    starts at any byte that is not 10xxxxxx) and ASCII-compatible one-byte encodings (latin-1, cp1252, ...)."""
    name = codecs.lookup(encoding).name
    if name in ("utf-8", "utf-8-sig"):
        return True
    try:
        with warnings.catch_warnings():  # unicode_escape warns of escapes such as "\]" in the bytes
            warnings.simplefilter("ignore", DeprecationWarning)
            every = bytes(range(256)).decode(encoding, errors="replace")
    except (UnicodeError, LookupError, TypeError):
        return False
    return len(every) == 256 and every[:128] == bytes(range(128)).decode("ascii")


def damaged(src: Source, e: BaseException) -> MinigptError:
    if isinstance(e, EOFError):
        return MinigptError(
            f"{src.path} is truncated: its {src.compression} stream ends early (an interrupted download or "
            f"copy?); fetch the file again"
        )
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return MinigptError(
        f"{src.path} is not valid {src.compression} data ({detail[:200]}); check the file or its name's suffix"
    )


# ---------------------------------------------------------------------------------------------- text


def _text_document(
    src: Source,
    blocks: Iterator[bytes],
    opts: ReadOptions,
    stats: ReadStats,
    offset: int,
    show_from: int,
    span: Span,
) -> Iterator[Piece]:
    """A text file is one document: its decoded text block by block, checked to be real text. The blocks
    start at byte `offset`; text decoded from bytes before `show_from` is not shown (it is the previous
    span's). A span that stops before the file's end leaves the document open: its last, incomplete
    character and the document's end are the next span's."""
    decoder = codecs.getincrementaldecoder(opts.encoding)(errors=opts.errors)
    check_surrogates = not codecs.lookup(opts.encoding).name.startswith(_SURROGATE_FREE_CODECS)
    ends = span.stop is None
    for block in _lookahead(blocks, ends):
        final = block is None
        data = b"" if final else block
        if offset < show_from:  # decode what comes before the span's start, showing nothing of it
            hidden = min(len(data), show_from - offset)
            _decode(src, opts, decoder, data[:hidden], offset, False)
            data, offset = data[hidden:], offset + hidden
        text = _decode(src, opts, decoder, data, offset, final)
        offset += len(data)
        if check_surrogates:
            text = without_surrogates(text, opts.errors, lambda c: _surrogate_message(src.path, opts, c))
        if text:
            if "\x00" in text:
                raise binary_error(src.path)
            stats.nonblank = stats.nonblank or not text.isspace()
            yield text
    stats.documents += 1
    if span.whole and not stats.nonblank:
        raise blank_error(src, opts)
    if ends:
        yield None


def _decode(src: Source, opts: ReadOptions, decoder: Any, data: bytes, offset: int, final: bool) -> str:
    """Bytes at `offset` of the file through the incremental decoder; undecodable ones a one-line error."""
    state = decoder.getstate()
    pending = len(state[0]) if isinstance(state[0], bytes) else 0
    try:
        return str(decoder.decode(data, final=final))
    except UnicodeDecodeError as e:
        where = offset - pending + e.start
        what = "byte offset" if src.compression is None else "decompressed byte offset"
        raise MinigptError(
            f"{src.path}: invalid {opts.encoding} at {what} {where:,} ({e.reason}); fix the file, "
            f"pass the right --encoding, or replace undecodable bytes with --encoding-errors replace"
        ) from None


def blank_error(src: Source, opts: ReadOptions) -> MinigptError:
    """The error for a file with no text in it (all of its parts read)."""
    if src.format == "text":
        return MinigptError(f"{src.path} contains only whitespace: there is no text in it")
    if src.format == "jsonl":
        return MinigptError(f"{src.path} holds no documents: no line has a non-empty {opts.text_field!r}")
    return MinigptError(f"{src.path} holds no documents: column {opts.text_field!r} has no text")


def _document(text: str, stats: ReadStats) -> Iterator[Piece]:
    """One whole document (a JSON line's or a Parquet row's text), counted."""
    stats.nonblank = True
    stats.documents += 1
    yield text
    yield None


def _lookahead(blocks: Iterator[bytes], final: bool) -> Iterator[bytes | None]:
    """The blocks, then (with `final`) None once they are done: the decoder's final call."""
    yield from blocks
    if final:
        yield None


def _surrogate_message(path: Path, opts: ReadOptions, char: str) -> str:
    return (
        f"{path}: decoding it as {opts.encoding} gives a lone surrogate (U+{ord(char):04X}), which is not "
        f"text; fix the file, pass the right --encoding, or replace such characters with "
        f"--encoding-errors replace"
    )


def without_surrogates(text: str, errors: str, message: Callable[[str], str]) -> str:
    """Text with its lone surrogates (not text: no tokenizer can encode one) treated as undecodable bytes
    are under `errors`: an error (`message` of the character), U+FFFD or dropped."""
    found = _SURROGATE.search(text)
    if found is None:
        return text
    if errors == "strict":
        raise MinigptError(message(found.group()))
    return _SURROGATE.sub("\ufffd" if errors == "replace" else "", text)


# ---------------------------------------------------------------------------------------------- JSON lines


LineNo = int | Callable[[], int]  # a line number, or how to count it (a span read from mid-file)


def _jsonl_documents(
    src: Source, blocks: Iterator[bytes], opts: ReadOptions, stats: ReadStats, start: int, whole: bool
) -> Iterator[Piece]:
    numbers = _LineNumbers(src, start)
    for lineno, line in _lines(src, blocks, opts, stats, numbers):
        text = record_text(src, lineno, line, opts, stats)
        if text:
            yield from _document(text, stats)
    if whole and not stats.nonblank and not stats.skipped:
        raise blank_error(src, opts)


@dataclass
class _LineNumbers:
    """Line numbers for messages: counted from the file's start, which a span from mid-file first reads
    through (only when a message needs one)."""

    src: Source
    start: int
    base: int | None = None

    def at(self, k: int) -> LineNo:
        """The number of the span's k-th line (1-based)."""
        if not self.start:
            return k
        return lambda: self._base() + k

    def _base(self) -> int:
        if self.base is None:
            with open(self.src.path, "rb") as raw:
                stream = OPENERS[self.src.compression](raw) if self.src.compression else raw
                blocks = byte_blocks(self.src, stream, Position(raw, lambda n: None), 0, self.start)
                self.base = sum(block.count(b"\n") for block in blocks)
        return self.base


def _lines(
    src: Source, blocks: Iterator[bytes], opts: ReadOptions, stats: ReadStats, numbers: _LineNumbers
) -> Iterator[tuple[LineNo, bytes]]:
    """(line number, line) of each non-blank line; a line past MAX_RECORD_BYTES is never held whole."""
    lineno = 0
    pending: list[bytes] = []
    pending_bytes = 0
    too_long = False  # skipping the rest of an overlong line
    for block in blocks:
        start = 0
        while (end := block.find(b"\n", start)) >= 0:
            lineno += 1
            if too_long:
                too_long = False
            else:
                line = b"".join([*pending, block[start:end]]) if pending else block[start:end]
                if line.strip():
                    yield numbers.at(lineno), line
            pending, pending_bytes = [], 0
            start = end + 1
        if start < len(block) and not too_long:
            pending.append(block[start:])
            pending_bytes += len(block) - start
            if pending_bytes > MAX_RECORD_BYTES:
                problem = f"a line longer than {MAX_RECORD_BYTES >> 20} MB"
                _bad(src, numbers.at(lineno + 1), problem, opts, stats)
                pending, pending_bytes, too_long = [], 0, True
    if pending and not too_long:
        line = b"".join(pending)
        if line.strip():
            yield numbers.at(lineno + 1), line


def record_text(src: Source, lineno: LineNo, line: bytes, opts: ReadOptions, stats: ReadStats) -> str | None:
    """The document a JSON line holds, or None where the line was bad and skipped."""
    try:
        decoded = line.decode("utf-8", opts.errors)
    except UnicodeDecodeError as e:
        return _bad(src, lineno, f"invalid UTF-8 at byte {e.start:,} of the line ({e.reason})", opts, stats)
    try:
        record = parse_json(decoded)
    except JsonError as e:
        return _bad(src, lineno, f"not valid JSON ({e})", opts, stats)
    if not isinstance(record, dict):
        return _bad(src, lineno, f"a JSON {type(record).__name__}, not an object", opts, stats)
    if opts.text_field not in record:
        keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
        return _bad(
            src, lineno, f"no {opts.text_field!r} field (it has {keys}; see --text-field)", opts, stats
        )
    text = record[opts.text_field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        return _bad(src, lineno, f"field {opts.text_field!r} is {kind}, not a string", opts, stats)
    if "\\u" in decoded and "\\ud" in decoded.lower():
        try:
            text = without_surrogates(text, opts.errors, lambda c: f"a lone surrogate (U+{ord(c):04X})")
        except MinigptError as e:
            return _bad(src, lineno, str(e), opts, stats)
    return text


def _bad(
    src: Source, lineno: LineNo, problem: str, opts: ReadOptions, stats: ReadStats, what: str = "line"
) -> None:
    n = lineno() if callable(lineno) else lineno
    where = f"{src.path}:{n}" if what == "line" else f"{src.path}: row {n:,}"
    if opts.skip_bad:
        stats.skip(f"{where}: {problem}")
        return None
    raise MinigptError(f"{where}: {problem}; fix the {what}, or pass --skip-bad-records to skip such {what}s")


# ---------------------------------------------------------------------------------------------- Parquet


def pyarrow_parquet() -> Any:
    """pyarrow.parquet, imported only when a Parquet file is read (an optional extra)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MinigptError(f"reading Parquet files needs pyarrow: {PARQUET_EXTRA}") from None
    return pq


def _parquet_documents(
    src: Source, opts: ReadOptions, advance: Callable[[int], None], stats: ReadStats, span: Span
) -> Iterator[Piece]:
    with open_parquet(src, opts) as (pf, column):
        rows = max(pf.metadata.num_rows, 1)
        start = span.start or 0
        row, reported = start, src.size * start // rows
        for batch in parquet_batches(src, pf, column, start, span.stop):
            for value in _values(src, batch):
                row += 1
                text = _parquet_text(src, row, value, opts, stats)
                if text:
                    yield from _document(text, stats)
            now = src.size * row // rows
            advance(now - reported)
            reported = now
    if span.whole and not stats.documents and not stats.skipped:
        raise blank_error(src, opts)


@contextlib.contextmanager
def open_parquet(src: Source, opts: ReadOptions) -> Iterator[tuple[Any, str]]:
    """The Parquet file (pyarrow's ParquetFile) and its text column, checked; damage is one line."""
    pq = pyarrow_parquet()
    import pyarrow as pa

    with parquet_path(src, opts) as path:
        try:
            pf = pq.ParquetFile(path)
            column = string_column(src, pf, opts.text_field)
        except (pa.ArrowException, OSError) as e:
            raise parquet_damaged(src, e) from None
        yield pf, column


@contextlib.contextmanager
def parquet_path(src: Source, opts: ReadOptions) -> Iterator[str]:
    """The file to open: itself, or (compressed) its decompressed copy in a temp file in `opts.spool`, since
    Parquet is read from its end; a copy past spool_cap(its size on disk) is a one-line error."""
    if src.compression is None:
        yield str(src.path)
        return
    if opts.spool is None:
        raise ValueError("reading a compressed Parquet file needs ReadOptions.spool, a folder for its copy")
    cap = spool_cap(src.size)

    def too_large() -> MinigptError:
        return MinigptError(
            f"{src.path} decompresses to more than {text_size(cap)}, the most minigpt copies out of a "
            f"compressed Parquet file of {text_size(src.size)} ({SPOOL_RATIO}x, at least "
            f"{text_size(SPOOL_FLOOR)}); decompress it yourself and pass the .parquet file"
        )

    with open(src.path, "rb") as raw, OPENERS[src.compression](raw) as stream:
        blocks = byte_blocks(src, stream, Position(raw, lambda n: None))  # damage: one line naming the file
        with spooled(blocks, opts.spool, cap, too_large) as path:
            yield str(path)


def string_column(src: Source, pf: Any, name: str) -> str:
    import pyarrow as pa

    schema = pf.schema_arrow
    if name not in schema.names:
        shown = ", ".join(repr(n) for n in schema.names[:8])
        raise MinigptError(
            f"{src.path} has no column {name!r} (it has {shown}); choose one with --text-field"
        )
    if (count := schema.names.count(name)) > 1:  # Parquet allows it; no column can be chosen by that name
        raise MinigptError(
            f"{src.path} has {count} columns named {name!r}, so none can be read by its name; rename one "
            f"(pyarrow: table.rename_columns) or choose another with --text-field"
        )
    kind = schema.field(name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise MinigptError(
            f"{src.path}: column {name!r} holds {kind}, not text; choose one with --text-field"
        )
    return name


def parquet_batches(
    src: Source, pf: Any, column: str, start: int = 0, stop: int | None = None
) -> Iterator[Any]:
    """Record batches of the text column's rows `start` to `stop`, read one row group at a time (row
    groups outside the rows are not read, and a row group is never decoded whole)."""
    import pyarrow as pa

    for group, (first, n) in enumerate(group_rows(pf)):
        lo, hi = max(start, first), first + n if stop is None else min(stop, first + n)
        if lo >= hi:
            continue
        at = first
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[column]):
                a, b = max(lo - at, 0), min(hi - at, len(batch))
                if a < b:
                    yield batch.slice(a, b - a)
                at += len(batch)
                if at >= hi:
                    break
        except (pa.ArrowException, OSError) as e:
            raise parquet_damaged(src, e, f" in row group {group}") from None


def group_rows(pf: Any) -> list[tuple[int, int]]:
    """(first row, rows) of each row group, from the file's metadata."""
    out, first = [], 0
    for group in range(pf.num_row_groups):
        n = pf.metadata.row_group(group).num_rows
        out.append((first, n))
        first += n
    return out


def _values(src: Source, batch: Any) -> list[Any]:
    try:
        return batch.column(0).to_pylist()
    except UnicodeDecodeError as e:  # Arrow strings are UTF-8; a writer that broke that broke the file
        raise MinigptError(
            f"{src.path} holds invalid UTF-8 in a text column ({e.reason}); check the file"
        ) from None


def parquet_damaged(src: Source, e: BaseException, where: str = "") -> MinigptError:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return MinigptError(f"{src.path} is not a readable Parquet file{where} ({detail[:200]}); check the file")


def _parquet_text(src: Source, row: int, value: Any, opts: ReadOptions, stats: ReadStats) -> str | None:
    if value is None:
        return _bad(src, row, f"{opts.text_field!r} is null", opts, stats, "row")
    if len(value) > MAX_RECORD_BYTES:
        return _bad(src, row, f"a value longer than {MAX_RECORD_BYTES >> 20} MB", opts, stats, "row")
    return value  # valid UTF-8 (else _values refused it), so free of lone surrogates
