"""Token streams over store chunks: the validation tokens, and the training stream that grows as chunks land.

A stream is a list of pieces (store chunks, read a slice at a time) seen as one array: len() and slices, which
is all the batch sampler and the evaluation need. Nothing is read from disk until a window is, and every slice read is
checked to hold only ids of the vocabulary (the store is not trusted; see minigpt.corpus.store).

Availability schedule: while a run started before its corpus was fully tokenized, batch b (counted from the
run's start) draws its windows from the training stream's first L(b) tokens, where L(b) is the end of the
first chunk at or past need(b) = (b + 1) x tokens per batch (all ranks) x RAMP_FACTOR, or everything once
that is tokenized. L(b) depends on the batch and the chunks' token counts (fixed by the content), never on
how fast tokenizing went: a batch whose chunks are not ready waits for them, so a resumed run and a run
with the same seed draw the same windows. A run that starts with its corpus tokenized draws from all of it.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from minigpt.corpus.ingest import Ingest
from minigpt.corpus.store import Chunk, ChunkIds
from minigpt.errors import MinigptError

# the training pool grows this many times faster than batches consume tokens: each token of the pool is
# drawn about 1/16 times on average while it grows, and tokenizing, far faster per core than training
# consumes tokens, keeps ahead of training on a CPU and of most GPUs
RAMP_FACTOR = 16


class TokenStream:
    """Pieces of token arrays read as one array: len() and slicing (a slice is a fresh ndarray, its ids
    checked to be below `vocab_size`)."""

    def __init__(self, dtype: np.dtype, vocab_size: int) -> None:
        self.dtype = np.dtype(dtype)
        self.vocab_size = vocab_size
        self.pieces: list[ChunkIds] = []
        self.paths: list[str] = []  # each piece's file, for messages
        self.starts: list[int] = [0]  # where each piece starts; the last entry is the total

    def append(self, ids: ChunkIds, path: str) -> None:
        if len(ids):
            self.pieces.append(ids)
            self.paths.append(path)
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
        i = bisect.bisect_right(self.starts, start) - 1
        out = []
        while start < stop:
            piece, base = self.pieces[i], self.starts[i]
            end = min(stop, self.starts[i + 1])
            ids = piece[start - base : end - base]
            if int(ids.max()) >= self.vocab_size:
                raise MinigptError(
                    f"{self.paths[i]} holds token id {int(ids.max()):,}, past the vocabulary "
                    f"({self.vocab_size:,}): the token store is damaged; delete {Path(self.paths[i]).parent} "
                    f"and run again"
                )
            out.append(ids)
            start, i = end, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out)  # each chunk's read is a fresh array


class GrowingStream(TokenStream):
    """The training stream: the chunks of the ingest's parts from `first` on, appended as they become
    ready, and what a batch may draw from (the schedule above)."""

    def __init__(self, ingest: Ingest, first: int, dtype: np.dtype) -> None:
        super().__init__(dtype, ingest.tokenizer.vocab_size)
        self.ingest = ingest
        self._next = (first, 0)  # the next chunk to append: (part, chunk)
        self.complete = False
        self.limit = 0  # what the last batch drew from: len() as evaluations see it
        self._boundaries: list[int] = []  # chunk ends in stream positions
        self.refresh()
        self.limit = self.total

    def refresh(self, wait: bool = False) -> None:
        """Append the chunks that are ready now (with `wait`, at least one more, or learn there is none)."""
        while not self.complete:
            j, k = self._next
            if j >= len(self.ingest.parts):
                self.complete = True
                return
            if wait:
                waited = self.ingest.wait_chunk(j, k)
                found: Chunk | bool | None = False if waited is None else waited  # None: no chunk k
            else:
                found = self.ingest.chunk(j, k)  # None: not known yet
            if found is None:
                return
            if found is False:
                self._next = (j + 1, 0)
                continue
            assert isinstance(found, Chunk)
            self.append(found.ids(self.dtype), str(found.bin_path))
            self._boundaries.append(self.total)
            self._next = (j, k + 1)
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


def validation_stream(ingest: Ingest, parts: int) -> tuple[TokenStream, int]:
    """The tokens of the first `parts` parts (waiting for them) and the bytes of text they spell."""
    val = TokenStream(ingest.entries[0].dtype, ingest.tokenizer.vocab_size)
    text = 0
    for _, _, chunk in ingest.walk(0, parts):
        val.append(chunk.ids(val.dtype), str(chunk.bin_path))
        text += chunk.text_bytes
    return val, text
