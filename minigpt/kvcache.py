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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from minigpt.errors import UsageError

__all__ = ["KVCache", "first_position", "gather_rows"]

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
        self.pos = 0

    def update(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        """Store k, v (b, H, T, hd) for positions pos..pos+T and return the keys and values the new
        queries attend to: every kept position in order, then the new ones, except that one new token
        into a full layer gets the whole buffer in slot order (a single query needs no order).

        A 1-row update of an empty cache fills every row: that is how B samples share one prefill of
        their common prompt.
        """
        rows, new = k.shape[0], k.shape[2]
        self._check(rows, new)
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

    def _check(self, rows: int, new: int) -> None:
        if self.limit is not None and self.pos + new > self.limit:
            raise UsageError(f"KV cache overflow: {self.pos + new} positions, room for {self.limit}")
        if rows != self.batch and not (rows == 1 and self.pos == 0):
            raise UsageError(f"KV cache holds {self.batch} rows, got {rows}")

    def _in_order(self, buf: Array) -> Array:
        """The positions a layer's buffer holds before pos, oldest first (a copy once it has wrapped)."""
        cap = buf.shape[2]
        if self.pos <= cap:
            return buf[:, :, : self.pos]
        split = self.pos % cap
        return buf[:, :, list(range(split, cap)) + list(range(split))]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused, not freed)."""
        self.pos = 0

    def copy_rows(self, source: KVCache[Array], start: int, stop: int, row: int) -> None:
        """Copy rows start:stop of `source` (at this cache's position) into this cache from `row` on."""
        for mine, theirs in ((self.k, source.k), (self.v, source.v)):
            for dst, src in zip(mine, theirs, strict=True):
                dst[row : row + stop - start] = src[start:stop]


def first_position(cache: KVCache[Any] | None, new: int, limit: int | None) -> int:
    """The position of the first of `new` tokens fed after the cached ones (0 without a cache), checked to
    leave the whole sequence inside `limit` positions (learned positions: block_size; None: no limit)."""
    start = cache.pos if cache is not None else 0
    if limit is not None and start + new > limit:
        raise UsageError(f"sequence of {start + new} tokens is longer than the model's block_size {limit}")
    return start


def gather_rows(
    new_cache: Callable[[int], KVCache[Array]], parts: Sequence[tuple[KVCache[Array], int, int]]
) -> KVCache[Array]:
    """A new cache (made by `new_cache(rows)`) of rows start:stop of each part's cache, in order, at their
    common position: how a server joins requests that reached one position and drops finished ones."""
    out = new_cache(sum(stop - start for _, start, stop in parts))
    row = 0
    for cache, start, stop in parts:
        out.copy_rows(cache, start, stop, row)
        row += stop - start
    out.advance(parts[0][0].pos)
    return out
