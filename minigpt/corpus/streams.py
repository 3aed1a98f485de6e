"""Token streams over store chunks: the validation split, and the training stream that grows as chunks land.

A stream is a list of memory-mapped pieces read as one array: len() and slices, which is all the batch
sampler and the evaluation need. Nothing is read from disk until a window is.

Availability schedule: while a run started before its corpus was fully tokenized, batch b (counted from the
run's start) draws its windows from the training stream's first L(b) tokens, where L(b) is the end of the
first chunk at or past need(b) = (b + 1) x tokens per batch (all ranks) x RAMP_FACTOR, or everything once
that is tokenized. L(b) depends on the batch and the chunks' token counts (fixed by the content), never on
how fast tokenizing went: a batch whose chunks are not ready waits for them, so a resumed run and a run
with the same seed draw the same windows. A run that starts with its corpus tokenized draws from all of it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from minigpt.corpus.ingest import Ingest
from minigpt.corpus.store import Chunk
from minigpt.errors import MinigptError

# the training pool grows this many times faster than batches consume tokens: each token of the pool is
# drawn about 1/16 times on average while it grows, and tokenizing (~2M tokens/s per core) keeps ahead of
# training on a CPU (~10-50k tokens/s) and of most GPUs
RAMP_FACTOR = 16
BLOCK_TOKENS = 1 << 22  # tokens read at a time when counting bytes


class TokenStream:
    """Pieces of token arrays read as one array: len() and slicing (a slice is a fresh ndarray)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.pieces: list[np.ndarray] = []
        self.starts: list[int] = [0]  # where each piece starts; the last entry is the total

    def append(self, ids: np.ndarray) -> None:
        if len(ids):
            self.pieces.append(ids)
            self.starts.append(self.starts[-1] + len(ids))

    @property
    def total(self) -> int:
        return self.starts[-1]

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("token streams are read by contiguous slices")
        start, stop, _ = key.indices(len(self))
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = bisect.bisect_right(self.starts, start) - 1
        out = []
        i = first
        while start < stop:
            piece, base = self.pieces[i], self.starts[i]
            end = min(stop, self.starts[i + 1])
            out.append(piece[start - base : end - base])
            start, i = end, i + 1
        return out[0].copy() if len(out) == 1 else np.concatenate(out)

    def count_bytes(self, lengths: np.ndarray, stop: int | None = None) -> int:
        """UTF-8 bytes the first `stop` tokens (all by default) spell, read in bounded blocks."""
        stop = len(self) if stop is None else stop
        return sum(
            int(lengths[self[i : min(i + BLOCK_TOKENS, stop)]].sum()) for i in range(0, stop, BLOCK_TOKENS)
        )


class GrowingStream(TokenStream):
    """The training stream: chunks of the ingest's training files from a starting point on, appended as
    they become ready, and what a batch may draw from (the schedule above)."""

    def __init__(self, ingest: Ingest, first: int, chunk: int, offset: int, dtype: np.dtype) -> None:
        super().__init__(dtype)
        self.ingest = ingest
        self._next = (first, chunk, offset)  # the next chunk to append (file, chunk, first token in it)
        self.complete = False
        self.limit = 0  # what the last batch drew from: len() as evaluations see it
        self._boundaries: list[int] = []  # chunk ends in stream positions
        self.refresh()
        self.limit = self.total

    def refresh(self, wait: bool = False) -> None:
        """Append the chunks that are ready now (with `wait`, at least one more, or learn there is none)."""
        while not self.complete:
            i, k, offset = self._next
            if i >= len(self.ingest.sources):
                self.complete = True
                return
            if wait:
                waited = self.ingest.wait_chunk(i, k)
                found: Chunk | bool | None = False if waited is None else waited  # None: no chunk k
            else:
                found = self.ingest.chunk(i, k)  # None: not known yet
            if found is None:
                return
            if found is False:
                self._next = (i + 1, 0, 0)
                continue
            assert isinstance(found, Chunk)
            self.append(found.ids(self.dtype)[offset:])
            self._boundaries.append(self.total)
            self._next = (i, k + 1, 0)
            wait = False

    def __len__(self) -> int:
        return self.limit

    def length_for(self, batch: int, ramp: bool, tokens_per_batch: int) -> int:
        """The stream length batch `batch` draws from, waiting for tokenizing to reach it."""
        self.ingest.raise_error()
        need = (batch + 1) * tokens_per_batch * RAMP_FACTOR if ramp else None
        self.refresh()
        while not self.complete and (need is None or self.total < need):
            self.refresh(wait=True)
        if need is None or self.total < need:
            self.limit = self.total
        else:
            self.limit = self._boundaries[bisect.bisect_left(self._boundaries, need)]
        return self.limit


@dataclass
class Split:
    """Validation tokens, and where the training stream starts."""

    val: TokenStream
    val_bytes: int
    train_start: tuple[int, int, int]  # (file, chunk, token offset in it)


def split_first_documents(ingest: Ingest, budget: int, fraction: float, lengths: np.ndarray) -> Split:
    """Validation = whole documents from the start of the corpus, about `budget` bytes of text (the one that
    crosses the budget included); where that document would make it more than twice the budget, or runs on
    into the next chunk (a corpus of one or a few large files), the cut falls inside it at the budget. A
    corpus with less text than its size on disk suggested is measured first and `fraction` of it taken."""
    split = _split_at(ingest, budget, lengths)
    if split is None:  # the budget was more than all the text: take its fraction instead
        total = sum(c.text_bytes for _, _, c in ingest.walk(0, len(ingest.sources)))
        split = _split_at(ingest, max(1, int(total * fraction)), lengths)
    if split is None:
        raise MinigptError(
            "the corpus is too small to hold out validation text; give more text or --val-file"
        )
    return split


def _split_at(ingest: Ingest, budget: int, lengths: np.ndarray) -> Split | None:
    dtype = ingest.entries[0].dtype
    val = TokenStream(dtype)
    taken = 0
    for i, k, chunk in ingest.walk(0, len(ingest.sources)):
        ids = chunk.ids(dtype)
        at = _token_at_bytes(ids, lengths, budget - taken)
        if at is None:
            val.append(ids)
            taken += chunk.text_bytes
            continue
        ends = chunk.doc_ends()
        j = int(np.searchsorted(ends, at, side="left"))
        cut = at
        if j < len(ends) and _bytes(ids, lengths, at, int(ends[j])) <= budget:
            cut = int(ends[j])
        val.append(ids[:cut])
        return Split(val, val.count_bytes(lengths), (i, k, cut))
    return None


def _bytes(ids: np.ndarray, lengths: np.ndarray, start: int, stop: int) -> int:
    return sum(
        int(lengths[ids[i : min(i + BLOCK_TOKENS, stop)]].sum()) for i in range(start, stop, BLOCK_TOKENS)
    )


def _token_at_bytes(ids: np.ndarray, lengths: np.ndarray, target: int) -> int | None:
    """The first token position by which `target` bytes of text are spelled (None: the chunk is shorter)."""
    done = 0
    for s in range(0, len(ids), BLOCK_TOKENS):
        cum = np.cumsum(lengths[ids[s : s + BLOCK_TOKENS]]) + done
        if len(cum) and cum[-1] >= target:
            return s + int(np.searchsorted(cum, target, side="left")) + 1
        done = int(cum[-1]) if len(cum) else done
    return None
