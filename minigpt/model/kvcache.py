"""The key/value cache of both engines: per-layer ring buffers of torch tensors or NumPy arrays.

Written against the slicing both array types share, so the torch model and the NumPy model cache the
same way: `update` writes a layer's new keys and values in place (no concatenation per step) and returns
what the layer's queries attend to; the forward pass calls `advance` once every layer has written, and
asks `first_position` where its new tokens go.

Each layer keeps as many positions as it attends to (`GPTConfig.layer_windows`): block_size for a full
layer, the window for a local one. Position p lives in slot p % capacity, so once a layer is full each
new token overwrites the oldest, the one that just left its window: a local layer, or any layer of a
rotary model (whose scores depend only on distances), decodes past its capacity at constant cost. Learned
positions stop at block_size (`limit`), and the decode loop re-reads a slid window instead.

Each row keeps its own position. Rows fed together usually share one (a prompt's samples, a batch of
prompts of one length); a server that joins requests begun at different times (`gather_rows`) makes a
cache whose rows stand at different positions, which then take one token a row per step: each row's key
goes into its own slot, and `key_mask` tells attention which of the returned slots each row has filled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from minigpt.errors import UsageError

__all__ = ["KVCache", "first_position", "gather_rows", "position_ids"]

Array = TypeVar("Array", bound=Any)  # torch.Tensor or np.ndarray: both slice and assign alike


class KVCache(Generic[Array]):
    """Keys and values of every layer, each a (batch, n_kv_head, capacity, head_dim) buffer."""

    def __init__(
        self, k: Sequence[Array], v: Sequence[Array], limit: int | None, cat: Callable[..., Array]
    ) -> None:
        """`limit`: the positions a sequence may reach (block_size with learned positions), None: any.
        `cat` joins arrays along an axis (torch.cat, np.concatenate): only a multi-token update of a
        full layer needs it."""
        self.k, self.v = list(k), list(v)
        self._cat = cat
        self.batch = k[0].shape[0]
        self.capacity = [layer.shape[2] for layer in k]
        self.limit = limit
        self.positions = np.zeros(self.batch, dtype=np.int64)  # each row's cached positions
        self._common: int | None = 0  # the rows' shared position; None while they differ

    @property
    def pos(self) -> int:
        """The position every row stands at (rows at different positions have none: `mixed`)."""
        if self._common is None:
            raise UsageError("the cache's rows stand at different positions: feed them one token each")
        return self._common

    @property
    def mixed(self) -> bool:
        """Whether the rows stand at different positions (a server's joined requests)."""
        return self._common is None

    def update(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        """Store k, v (b, H, T, hd) for positions pos..pos+T and return the keys and values the new
        queries attend to: every kept position in order, then the new ones, except that one new token
        into a full layer gets the whole buffer in slot order (a single query needs no order).

        A 1-row update of an empty cache fills every row: that is how B samples share one prefill of
        their common prompt. Rows at different positions take one token each (`_update_rows`).
        """
        rows, new = k.shape[0], k.shape[2]
        self._check(rows, new)
        if self._common is None:
            return self._update_rows(layer, k, v)
        cap, end = self.capacity[layer], self.pos + new
        kl, vl = self.k[layer], self.v[layer]
        if end <= cap:  # nothing overwritten yet: the buffer's prefix is the sequence so far
            kl[:, :, self.pos : end] = k
            vl[:, :, self.pos : end] = v
            return kl[:rows, :, :end], vl[:rows, :, :end]
        if new == 1:
            slot = self.pos % cap
            kl[:, :, slot : slot + 1] = k
            vl[:, :, slot : slot + 1] = v
            return kl[:rows], vl[:rows]
        kept = self._in_order(kl[:rows]), self._in_order(vl[:rows])
        keys, values = self._cat([kept[0], k], 2), self._cat([kept[1], v], 2)
        slots = [p % cap for p in range(max(self.pos, end - cap), end)]
        kl[:, :, slots] = k[:, :, new - len(slots) :]
        vl[:, :, slots] = v[:, :, new - len(slots) :]
        return keys, values

    def _update_rows(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        """One new token a row, each row at its own position: its key and value into slot position %
        capacity; returned, the slots any row has filled (`key_mask` says which are each row's)."""
        if k.shape[2] != 1:
            raise UsageError("the cache's rows stand at different positions: feed them one token each")
        cap = self.capacity[layer]
        rows, slots = list(range(self.batch)), (self.positions % cap).tolist()
        kl, vl = self.k[layer], self.v[layer]
        kl[rows, :, slots] = k[:, :, 0]
        vl[rows, :, slots] = v[:, :, 0]
        end = min(int(self.positions.max()) + 1, cap)
        return kl[:, :, :end], vl[:, :, :end]

    def key_mask(self, layer: int) -> np.ndarray | None:
        """(batch, keys) booleans, True where a row's new token may see the key `update` returned in that
        slot: the slots its own positions filled (None when the rows share a position: all of them)."""
        if self._common is None:
            seen = np.minimum(self.positions + 1, self.capacity[layer])
            return np.arange(int(seen.max()))[None, :] < seen[:, None]
        return None

    def _check(self, rows: int, new: int) -> None:
        end = (int(self.positions.max()) if self._common is None else self._common) + new
        if self.limit is not None and end > self.limit:
            raise UsageError(f"KV cache overflow: {end} positions, room for {self.limit}")
        if rows != self.batch and not (rows == 1 and self._common == 0):
            raise UsageError(f"KV cache holds {self.batch} rows, got {rows}")

    def _in_order(self, buf: Array) -> Array:
        """The positions a layer's buffer holds before pos, oldest first (a copy once it has wrapped)."""
        cap = buf.shape[2]
        if self.pos <= cap:
            return buf[:, :, : self.pos]
        split = self.pos % cap
        return buf[:, :, list(range(split, cap)) + list(range(split))]

    def advance(self, n: int) -> None:
        if self._common is None:
            self.positions += n
        else:  # `fill`, not a ufunc: after a step has streamed the weights through the CPU's caches,
            # NumPy's ufunc machinery is slow to come back to, and fill is several times quicker
            self._common += n
            self.positions.fill(self._common)

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused, not freed)."""
        self.positions[:] = 0
        self._common = 0

    def copy_rows(self, source: KVCache[Array], start: int, stop: int, row: int) -> None:
        """Copy rows start:stop of `source`, with their positions, into this cache from `row` on: the
        slots they have filled (a server joins and parts requests often; the rest is never read)."""
        cached = int(source.positions[start:stop].max(initial=0))
        for mine, theirs in ((self.k, source.k), (self.v, source.v)):
            for dst, src, cap in zip(mine, theirs, self.capacity, strict=True):
                dst[row : row + stop - start, :, : min(cached, cap)] = src[start:stop, :, : min(cached, cap)]
        self.positions[row : row + stop - start] = source.positions[start:stop]
        first = int(self.positions[0])
        self._common = first if bool((self.positions == first).all()) else None


def first_position(cache: KVCache[Any] | None, new: int, limit: int | None) -> int | np.ndarray:
    """The position of the first of `new` tokens fed after the cached ones (0 without a cache), checked to
    leave the whole sequence inside `limit` positions (learned positions: block_size; None: no limit); for
    a cache whose rows stand at different positions (`KVCache.mixed`), each row's (batch,)."""
    start: int | np.ndarray = 0 if cache is None else cache.positions.copy() if cache.mixed else cache.pos
    end = (int(start.max()) if isinstance(start, np.ndarray) else start) + new  # no NumPy call per token
    if limit is not None and end > limit:
        raise UsageError(f"sequence of {end} tokens is longer than the model's block_size {limit}")
    return start


def position_ids(start: int | np.ndarray, new: int) -> np.ndarray:
    """The positions of `new` tokens from `first_position`'s answer: (new,), or (batch, 1) for rows at
    different positions (which take one token each)."""
    if isinstance(start, np.ndarray):
        return start[:, None]
    return np.arange(start, start + new)


def gather_rows(
    new_cache: Callable[[int], KVCache[Array]], parts: Sequence[tuple[KVCache[Array], int, int]]
) -> KVCache[Array]:
    """A new cache (made by `new_cache(rows)`) of rows start:stop of each part's cache, in order, each row
    at its own position: how a server joins requests and drops finished ones."""
    out = new_cache(sum(stop - start for _, start, stop in parts))
    row = 0
    for cache, start, stop in parts:
        out.copy_rows(cache, start, stop, row)
        row += stop - start
    return out
