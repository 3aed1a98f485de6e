"""Documents out of corpus files: plain text, JSON lines and Parquet, each plain or compressed.

A reader yields a document as one or more text pieces followed by None (the document's end). Every bad
input is a one-line MinigptError naming the file and, where there is one, the line or row.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import gzip
import json
import lzma
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from minigpt.corpus.inputs import READ_BYTES, Source, binary_error
from minigpt.errors import MinigptError

try:  # Python 3.14's standard library; the backport before it
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd  # type: ignore[no-redef]

MAX_RECORD_BYTES = 64 << 20  # one JSON line or Parquet value; a larger one is damage or not a document
PARQUET_BATCH_ROWS = 4096  # rows decoded at a time: one row group is never held whole
PARQUET_EXTRA = "pip install 'minigpt[parquet]'"
# Python's UTF decoders never yield a lone surrogate; others can (utf-7, unicode_escape, punycode), and
# JSON can spell one (\ud800), so only such text is searched for one (a search costs ~5 ms per MB)
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

    def key(self, fmt: str) -> dict[str, Any]:
        """The settings that shape the documents of a file of this format."""
        if fmt == "text":
            return {"encoding": self.encoding, "errors": self.errors}
        return {"errors": self.errors, "field": self.text_field, "skip_bad": self.skip_bad}


@dataclass
class ReadStats:
    """What reading found besides documents: bad records skipped, with the first one in words."""

    skipped: int = 0
    first_skipped: str = ""
    documents: int = 0

    def skip(self, where: str) -> None:
        self.skipped += 1
        self.first_skipped = self.first_skipped or where


@dataclass
class _Position:
    """Raw (on-disk) bytes consumed so far, reported to `advance` as they grow."""

    raw: IO[bytes]
    advance: Callable[[int], None]
    done: int = 0
    total: int = field(default=0)

    def update(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            now = self.raw.tell()
            if now > self.done:
                self.advance(now - self.done)
                self.done = now

    def finish(self, size: int) -> None:
        if size > self.done:
            self.advance(size - self.done)
            self.done = size


def documents(
    src: Source, opts: ReadOptions, advance: Callable[[int], None], stats: ReadStats | None = None
) -> Iterator[Piece]:
    """The documents of one file as pieces, each document closed by None; `advance` hears the file's
    bytes as they are read."""
    stats = stats if stats is not None else ReadStats()
    if src.format == "parquet":
        yield from _parquet_documents(src, opts, advance, stats)
        return
    try:
        raw = open(src.path, "rb")  # noqa: SIM115 - closed below, after the generator is done with it
    except OSError as e:
        raise MinigptError(f"cannot read {src.path}: {e.strerror}") from None
    with raw:
        position = _Position(raw, advance)
        stream = OPENERS[src.compression](raw) if src.compression else raw
        blocks = _blocks(src, stream, position)
        if src.format == "jsonl":
            yield from _jsonl_documents(src, blocks, opts, stats)
        else:
            yield from _text_document(src, blocks, opts)
            stats.documents += 1
        position.finish(src.size)


def _blocks(src: Source, stream: IO[bytes], position: _Position) -> Iterator[bytes]:
    """The file's (decompressed) bytes block by block; damage is one line naming the file."""
    while True:
        try:
            block = stream.read(READ_BYTES)
        except CORRUPT as e:
            raise damaged(src, e) from None
        position.update()
        if not block:
            return
        yield block


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


def _text_document(src: Source, blocks: Iterator[bytes], opts: ReadOptions) -> Iterator[Piece]:
    """A text file is one document: its decoded text block by block, checked to be real text."""
    decoder = codecs.getincrementaldecoder(opts.encoding)(errors=opts.errors)
    check_surrogates = not codecs.lookup(opts.encoding).name.startswith(_SURROGATE_FREE_CODECS)
    offset = 0  # bytes fed to the decoder so far
    nonblank = False
    for block in _lookahead(blocks):
        final = block is None
        data = b"" if final else block
        state = decoder.getstate()
        pending = len(state[0]) if isinstance(state[0], bytes) else 0
        try:
            text = decoder.decode(data, final=final)
        except UnicodeDecodeError as e:
            where = offset - pending + e.start
            what = "byte offset" if src.compression is None else "decompressed byte offset"
            raise MinigptError(
                f"{src.path}: invalid {opts.encoding} at {what} {where:,} ({e.reason}); fix the file, "
                f"pass the right --encoding, or replace undecodable bytes with --encoding-errors replace"
            ) from None
        offset += len(data)
        if check_surrogates:
            text = without_surrogates(text, opts.errors, lambda c: _surrogate_message(src.path, opts, c))
        if text:
            if "\x00" in text:
                raise binary_error(src.path)
            nonblank = nonblank or not text.isspace()
            yield text
    if not nonblank:
        raise MinigptError(f"{src.path} contains only whitespace: there is no text in it")
    yield None


def _lookahead(blocks: Iterator[bytes]) -> Iterator[bytes | None]:
    """The blocks, then None once they are done (the decoder's final call)."""
    yield from blocks
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


def _jsonl_documents(
    src: Source, blocks: Iterator[bytes], opts: ReadOptions, stats: ReadStats
) -> Iterator[Piece]:
    nonblank = False
    for lineno, line in _lines(src, blocks, opts, stats):
        text = record_text(src, lineno, line, opts, stats)
        if text:
            nonblank = True
            stats.documents += 1
            yield text
            yield None
    if not nonblank and not stats.skipped:
        raise MinigptError(f"{src.path} holds no documents: no line has a non-empty {opts.text_field!r}")


def _lines(
    src: Source, blocks: Iterator[bytes], opts: ReadOptions, stats: ReadStats
) -> Iterator[tuple[int, bytes]]:
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
                    yield lineno, line
            pending, pending_bytes = [], 0
            start = end + 1
        if start < len(block) and not too_long:
            pending.append(block[start:])
            pending_bytes += len(block) - start
            if pending_bytes > MAX_RECORD_BYTES:
                _bad(src, lineno + 1, f"a line longer than {MAX_RECORD_BYTES >> 20} MB", opts, stats)
                pending, pending_bytes, too_long = [], 0, True
    if pending and not too_long:
        line = b"".join(pending)
        if line.strip():
            yield lineno + 1, line


def record_text(src: Source, lineno: int, line: bytes, opts: ReadOptions, stats: ReadStats) -> str | None:
    """The document a JSON line holds, or None where the line was bad and skipped."""
    try:
        decoded = line.decode("utf-8", opts.errors)
    except UnicodeDecodeError as e:
        return _bad(src, lineno, f"invalid UTF-8 at byte {e.start:,} of the line ({e.reason})", opts, stats)
    try:
        record = json.loads(decoded)
    except (ValueError, RecursionError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        return _bad(src, lineno, f"not valid JSON ({reason})", opts, stats)
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
    src: Source, lineno: int, problem: str, opts: ReadOptions, stats: ReadStats, what: str = "line"
) -> None:
    where = f"{src.path}:{lineno}" if what == "line" else f"{src.path}: row {lineno:,}"
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
    src: Source, opts: ReadOptions, advance: Callable[[int], None], stats: ReadStats
) -> Iterator[Piece]:
    pq = pyarrow_parquet()
    import pyarrow as pa

    with parquet_path(src) as path:
        try:
            pf = pq.ParquetFile(path)
            column = string_column(src, pf, opts.text_field)
        except (pa.ArrowException, OSError) as e:
            raise parquet_damaged(src, e) from None
        rows = max(pf.metadata.num_rows, 1)
        row, reported = 0, 0
        for batch in _parquet_batches(src, pf, column):
            for value in _values(src, batch):
                row += 1
                text = _parquet_text(src, row, value, opts, stats)
                if text:
                    stats.documents += 1
                    yield text
                    yield None
            now = src.size * row // rows
            advance(now - reported)
            reported = now
        advance(src.size - reported)
    if not stats.documents and not stats.skipped:
        raise MinigptError(f"{src.path} holds no documents: column {opts.text_field!r} has no text")


@contextlib.contextmanager
def parquet_path(src: Source) -> Iterator[str]:
    """The file to open: itself, or (compressed) its decompressed copy in a temp file, since Parquet is read
    from its end."""
    if src.compression is None:
        yield str(src.path)
        return
    with tempfile.NamedTemporaryFile(prefix="minigpt-", suffix=".parquet") as tmp:
        try:
            with open(src.path, "rb") as raw, OPENERS[src.compression](raw) as stream:
                shutil.copyfileobj(stream, tmp, READ_BYTES)
        except CORRUPT as e:
            raise damaged(src, e) from None
        tmp.flush()
        yield tmp.name


def string_column(src: Source, pf: Any, name: str) -> str:
    import pyarrow as pa

    schema = pf.schema_arrow
    if name not in schema.names:
        shown = ", ".join(repr(n) for n in schema.names[:8])
        raise MinigptError(
            f"{src.path} has no column {name!r} (it has {shown}); choose one with --text-field"
        )
    kind = schema.field(name).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise MinigptError(
            f"{src.path}: column {name!r} holds {kind}, not text; choose one with --text-field"
        )
    return name


def _parquet_batches(src: Source, pf: Any, column: str) -> Iterator[Any]:
    import pyarrow as pa

    for group in range(pf.num_row_groups):
        try:
            yield from pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[column])
        except (pa.ArrowException, OSError) as e:
            raise parquet_damaged(src, e, f" in row group {group}") from None


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
