"""Documents to token ids at the encoder's speed: batched into jobs, encoded on threads, written in chunks.

tiktoken releases the GIL while it encodes, so jobs of about a million characters run on every core at once
(threads, not processes: no text is pickled). A job joins small documents with the end-of-text token's
text and encodes them in one call that allows only that special token: tiktoken encodes the text between
special tokens separately, so this gives exactly the ids of encoding each document alone and appending the
end-of-text id. A large document is cut where the split pattern starts a new pre-token anyway, so its
pieces encode to the ids of the whole.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from minigpt.corpus.readers import Piece
from minigpt.corpus.store import Chunk, Entry
from minigpt.errors import MinigptError
from minigpt.tokenizer.base import ENDOFTEXT, Tokenizer
from minigpt.tokenizer.char import CharTokenizer

PIECE_CHARS = 1 << 20  # characters per encoding job (one thread each)
CHUNK_FIRST_CHARS = 4 << 20  # the first chunk of a file is small, so training can start soon
CHUNK_MAX_CHARS = 64 << 20  # chunks double in size up to this
# a job this small is encoded on the calling thread: handing it to another thread costs more than encoding
# it (a folder of tiny files is a job a file)
INLINE_CHARS = 1 << 16


class Stopped(Exception):
    """Tokenizing was asked to stop (the run ended first); the finished chunks stay in the store."""


def chunk_target(index: int) -> int:
    """Characters after which chunk `index` of a file closes (at the next job boundary)."""
    return min(CHUNK_MAX_CHARS, CHUNK_FIRST_CHARS << min(index, 30))


@dataclass
class Job:
    """Text to encode in one call: document pieces, with None where a document ends."""

    segments: list[Piece]
    chars: int


def safe_cut(text: str, limit: int) -> int:
    """A cut point in (limit/2, limit] where every split pattern we use starts a new pre-token anyway,
    so encoding the pieces separately gives the same ids as encoding the whole text.
    """
    lo = limit // 2
    end = limit
    # after a newline that a letter or digit follows: no pattern joins "\n" to a following word
    while (i := text.rfind("\n", lo, end)) >= 0:
        if text[i + 1].isalnum():
            return i + 1
        end = i
    # else before the space of "word word": the space begins the next word's pre-token
    end = limit
    while (i := text.rfind(" ", lo, end)) > 0:
        if text[i - 1].isalpha() and text[i + 1].isalpha():
            return i
        end = i
    return limit  # no such point (one huge "word"): the split differs but still round-trips exactly


def jobs(pieces: Iterator[Piece], size: int | None = None) -> Iterator[Job]:
    """Pieces regrouped into jobs of about `size` (PIECE_CHARS) characters: small documents together, a
    large one cut."""
    size = size or PIECE_CHARS
    closed: list[Piece] = []
    chars = 0
    buf = ""  # the open document's text not yet in a job
    for piece in pieces:
        if piece is None:
            if buf:
                closed.append(buf)
                chars += len(buf)
                buf = ""
            closed.append(None)
            if chars >= size:
                yield Job(closed, chars)
                closed, chars = [], 0
            continue
        buf = buf + piece if buf else piece
        while chars + len(buf) > size:
            room = size - chars
            if room < size // 2:  # little room left: send what the job has, cut the text in the next
                yield Job(closed, chars)
                closed, chars = [], 0
                continue
            cut = safe_cut(buf, room)
            closed.append(buf[:cut])
            yield Job(closed, chars + cut)
            closed, chars, buf = [], 0, buf[cut:]
    if buf:
        closed.append(buf)
        chars += len(buf)
    if closed:
        yield Job(closed, chars)


@dataclass
class Encoded:
    ids: np.ndarray  # uint32
    unknown: set[str] = field(default_factory=set)  # characters a char tokenizer lacks


class Encoder:
    """One job's ids and document ends, for any tokenizer (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eot = tokenizer.eot_id
        self.lengths = tokenizer.text_byte_lengths()

    def __call__(self, job: Job) -> Encoded:
        encoding = getattr(self.tokenizer, "encoding", None)  # a tiktoken Encoding (bpe and tiktoken kinds)
        if encoding is not None and self.eot is not None and not _has_literal_eot(job):
            text = "".join(ENDOFTEXT if s is None else s for s in job.segments)
            ids = encoding.encode_to_numpy(text, allowed_special={ENDOFTEXT}, disallowed_special=())
            return Encoded(ids.astype(np.uint32, copy=False))
        return self._piecewise(job)

    def _piecewise(self, job: Job) -> Encoded:
        """Each segment alone: a char tokenizer, no end-of-text token, or text that spells the token."""
        parts: list[np.ndarray] = []
        unknown: set[str] = set()
        for segment in job.segments:
            if segment is None:
                if self.eot is not None:
                    parts.append(np.array([self.eot], dtype=np.uint32))
                continue
            if isinstance(self.tokenizer, CharTokenizer):
                ids = self.tokenizer.lookup(segment)
                if (ids < 0).any():
                    unknown |= self.tokenizer.unknown_chars(segment)
                    ids = np.maximum(ids, 0)
                ids = ids.astype(np.uint32)
            else:
                ids = self.tokenizer.encode_arrays([segment], 1)[0]
            parts.append(ids)
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        return Encoded(ids, unknown)

    def text_bytes(self, ids: np.ndarray) -> int:
        return int(self.lengths[ids].sum())


def _has_literal_eot(job: Job) -> bool:
    return any(s is not None and ENDOFTEXT in s for s in job.segments)


@dataclass
class _Open:
    """The chunk being written."""

    index: int
    chars: int = 0
    existing: Chunk | None = None  # found whole in the store: its jobs are read but not encoded
    parts: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0
    text_bytes: int = 0


def tokenize_file(
    pieces: Iterator[Piece],
    entry: Entry,
    encoder: Encoder,
    pool: ThreadPoolExecutor,
    threads: int,
    on_chunk: Callable[[int, Chunk], None],
    stop: threading.Event,
    where: str,
    *,
    unchanged: Callable[[], None],
) -> list[Chunk]:
    """Encode one file's documents into its store entry chunk by chunk (chunks already there, whole, are
    kept and not encoded again); `on_chunk` hears each chunk as it lands. `unchanged` (which raises if the
    file changed since it was stamped) is called before a chunk lands while the file is read, and once it
    is read. At most 2 jobs per thread are in memory at once, whatever the file's size."""
    chunks: list[Chunk] = []
    pending: deque[tuple[_Open, Future[Encoded] | None]] = deque()
    unknown: set[str] = set()
    current = _Open(0, existing=entry.chunk(0, verify=True))
    check = unchanged

    def drain(limit: int) -> None:
        while len(pending) > limit:
            chunk, future = pending.popleft()
            if future is not None:
                encoded = future.result()
                unknown.update(encoded.unknown)
                chunk.parts.append(encoded.ids.astype(entry.dtype))
                chunk.tokens += len(encoded.ids)
                chunk.text_bytes += encoder.text_bytes(encoded.ids)
            else:
                landed = _close(entry, chunk, bool(unknown), check)
                if landed is not None:
                    chunks.append(landed)
                    on_chunk(chunk.index, landed)

    try:
        for job in jobs(pieces):
            if stop.is_set():
                raise Stopped
            if current.existing is None:
                pending.append((current, _submit(pool, encoder, job)))
            current.chars += job.chars
            if current.chars >= chunk_target(current.index):
                pending.append((current, None))
                index = current.index + 1
                current = _Open(index, existing=entry.chunk(index, verify=True))
            drain(2 * threads)
        if current.chars or any(chunk is current for chunk, _ in pending):
            pending.append((current, None))
        unchanged()  # the file is read: the chunks left to land were read from it as it was stamped
        check = _already_checked
        drain(0)
    except BaseException:
        _cancel(pending)
        raise
    if unknown:
        raise MinigptError(CharTokenizer.unknown_message(unknown, where))
    return chunks


def _cancel(pending: deque[tuple[_Open, Future[Encoded] | None]]) -> None:
    """Drop the encodings not started yet: the file's tokens are not wanted any more."""
    for _, future in pending:
        if future is not None:
            future.cancel()


def _already_checked() -> None:
    """The check of a chunk that lands once its whole file was read and found unchanged: none left."""


def _submit(pool: ThreadPoolExecutor, encoder: Encoder, job: Job) -> Future[Encoded]:
    """The job's encoding: on the pool, or (a small job) here and now."""
    if job.chars >= INLINE_CHARS:
        return pool.submit(encoder, job)
    encoded: Future[Encoded] = Future()
    encoded.set_result(encoder(job))
    return encoded


def _close(entry: Entry, chunk: _Open, failed: bool, unchanged: Callable[[], None]) -> Chunk | None:
    if chunk.existing is not None:
        return chunk.existing
    if failed:  # unknown characters: the error comes once the whole file has been read
        return None
    ids = np.concatenate(chunk.parts) if chunk.parts else np.zeros(0, dtype=entry.dtype)
    if not len(ids):
        return None
    unchanged()  # every id of the chunk was read from the file as it was stamped
    return entry.write_chunk(chunk.index, ids, chunk.text_bytes)
