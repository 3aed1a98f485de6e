"""The text a tokenizer learns from: all of a small corpus, or a sample drawn evenly across a large one.

The sample is --tokenizer-sample bytes of text, counted after decompression. Each file contributes in
proportion to its size on disk, as regions spread evenly through it: plain files are read at evenly spaced
offsets, Parquet files at evenly spaced row groups. A compressed file cannot be read from its middle: its
share is the start of its decompressed text, so however much a small file decompresses to, the sample
decompresses no more than its share. A corpus smaller on disk than the sample gives all of its text, up to
the sample's size. A region starts and ends on line boundaries, so JSON lines are parsed whole; plain text
may lose a partial character at the cut, replaced by U+FFFD.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from minigpt.corpus.inputs import Source, ascii_compatible
from minigpt.corpus.readers import (
    PARQUET_BATCH_ROWS,
    ReadOptions,
    ReadStats,
    documents,
    parquet_damaged,
    parquet_path,
    pyarrow_parquet,
    record_text,
    string_column,
)

REGION_BYTES = 1 << 18  # bytes per sampled region
TRAIN_PIECE_CHARS = 1 << 18  # characters per string handed to the BPE trainer


def corpus_texts(
    sources: Iterable[Source], opts: ReadOptions, advance: Callable[[int], None]
) -> Iterator[str]:
    """Every document of the sources, grouped into strings of about TRAIN_PIECE_CHARS characters."""
    for src in sources:
        yield from _grouped(documents(src, opts, advance))


def _grouped(pieces: Iterable[str | None]) -> Iterator[str]:
    """Documents joined by newlines into strings of about TRAIN_PIECE_CHARS (a long one handed over in parts)."""
    docs: list[str] = []  # finished documents of the current string
    current: list[str] = []  # pieces of the open document
    size = 0
    for piece in pieces:
        if piece is None:
            docs.append("".join(current))
            current = []
            if size >= TRAIN_PIECE_CHARS:
                yield "\n".join(docs)
                docs, size = [], 0
            continue
        current.append(piece)
        size += len(piece)
        if size >= 4 * TRAIN_PIECE_CHARS:
            yield "\n".join([*docs, "".join(current)])
            docs, current, size = [], [], 0
    rest = [*docs, "".join(current)] if current else docs
    if rest:
        yield "\n".join(rest)


def sample_texts(
    sources: list[Source], opts: ReadOptions, budget: int, advance: Callable[[int], None]
) -> Iterator[str]:
    """About `budget` characters of text drawn evenly across the sources (all of them when they hold
    fewer); `advance` hears bytes on disk as sample_bytes counts them."""
    total = sum(s.size for s in sources)
    if total <= budget:
        yield from _capped(corpus_texts(sources, opts, advance), budget)
        return
    for src in sources:
        quota = budget * src.size // total
        regions = max(1, -(-quota // REGION_BYTES))
        if src.format == "parquet":
            yield from _grouped(_parquet_sample(src, opts, regions, quota))
            advance(src.size)
        elif _from_start(src, opts):
            yield from _grouped(_head(documents(src, opts, lambda n: None), quota))
            advance(src.size)
        else:
            for offset, region in _regions(src, regions, advance):
                yield from _region_texts(src, offset, region, opts)


def sample_bytes(sources: list[Source], opts: ReadOptions, budget: int) -> int:
    """Bytes on disk a sample of `budget` reports to its `advance`: each file's share, or all of a file
    sampled from its start or its row groups."""
    total = sum(s.size for s in sources)
    if total <= budget:
        return total
    return sum(
        s.size if s.format == "parquet" or _from_start(s, opts) else budget * s.size // total for s in sources
    )


def _from_start(src: Source, opts: ReadOptions) -> bool:
    """Whether a file's sample is the start of its text: compressed, or in an encoding that cannot be
    decoded from its middle."""
    return src.compression is not None or src.format == "text" and not ascii_compatible(opts.encoding)


def _capped(texts: Iterator[str], budget: int) -> Iterator[str]:
    """The texts up to `budget` characters in all (the last one cut)."""
    taken = 0
    for text in texts:
        yield text[: budget - taken]
        taken += len(text)
        if taken >= budget:
            return


def _regions(src: Source, n: int, advance: Callable[[int], None]) -> Iterator[tuple[int, bytes]]:
    """n regions of REGION_BYTES bytes evenly spaced through a plain file: (offset, bytes)."""
    with open(src.path, "rb") as raw:
        for target in (src.size * i // n for i in range(n)):
            raw.seek(target)
            region = raw.read(REGION_BYTES)
            advance(len(region))
            yield target, region


def _region_texts(src: Source, offset: int, region: bytes, opts: ReadOptions) -> Iterator[str]:
    """The whole lines of a region (its first, partial one dropped unless the region starts the file)."""
    start = 0 if offset == 0 else region.find(b"\n") + 1
    end = region.rfind(b"\n") + 1 or len(region)
    if start <= 0 < offset or start >= end:
        return
    body = region[start:end]
    if src.format == "jsonl":
        # bad lines are left out here: tokenizing reads every line and reports them with their numbers
        lenient, stats = replace(opts, skip_bad=True), ReadStats()
        texts = [record_text(src, 0, line, lenient, stats) for line in body.split(b"\n") if line.strip()]
        yield "\n".join(t for t in texts if t)
    elif ascii_compatible(opts.encoding):
        yield body.decode(opts.encoding, errors="replace")


def _head(pieces: Iterator[str | None], quota: int) -> Iterator[str | None]:
    """The first `quota` characters of the documents (a file that cannot be read from the middle)."""
    taken = 0
    for piece in pieces:
        yield piece
        taken += len(piece) if piece else 0
        if taken >= quota:
            yield None
            return


def _parquet_sample(src: Source, opts: ReadOptions, regions: int, quota: int) -> Iterator[str | None]:
    """Documents from evenly spaced row groups, about quota bytes in all."""
    import pyarrow as pa

    pq = pyarrow_parquet()
    with parquet_path(src, opts) as path:
        try:
            pf = pq.ParquetFile(path)
            yield from _row_group_sample(pf, string_column(src, pf, opts.text_field), regions, quota)
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise parquet_damaged(src, e) from None


def _row_group_sample(pf: Any, column: str, regions: int, quota: int) -> Iterator[str | None]:
    groups = pf.num_row_groups
    chosen = sorted({groups * i // regions for i in range(min(regions, groups))})
    per_group = quota // max(len(chosen), 1)
    for group in chosen:
        taken = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[column]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, str) and value:
                    yield value
                    yield None
                    taken += len(value)
                if taken >= per_group:
                    break
            if taken >= per_group:
                break
