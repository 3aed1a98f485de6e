"""The key/value cache of both engines: preallocated per-layer buffers of torch tensors or NumPy arrays.

Written against the slicing both array types share, so the torch model and the NumPy model cache the
same way: `update` writes a layer's new keys and values in place (no concatenation per step) and returns
views of everything cached so far; the forward pass calls `advance` once every layer has written, and
asks `first_position` where its new tokens go.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from minigpt.errors import UsageError

__all__ = ["KVCache", "first_position"]

Array = TypeVar("Array", bound=Any)  # torch.Tensor or np.ndarray: both slice and assign alike


class KVCache(Generic[Array]):
    """Keys and values of every layer in two (n_layer, batch, n_head, block_size, head_dim) buffers."""

    def __init__(self, k: Array, v: Array) -> None:
        self.k, self.v = k, v
        # per-layer views, so a step indexes one small array rather than the 5-d buffer
        self._k = [k[i] for i in range(k.shape[0])]
        self._v = [v[i] for i in range(v.shape[0])]
        self.batch, self.block_size = k.shape[1], k.shape[3]
        self.pos = 0

    def update(self, layer: int, k: Array, v: Array) -> tuple[Array, Array]:
        """Store k, v (b, H, T, hd) at pos..pos+T; a 1-row update of an empty cache fills every row.

        That is how B samples share one prefill of their common prompt: the prompt runs as one row, its
        keys and values are broadcast into all B rows, and the following steps run all B rows.
        """
        rows, end = k.shape[0], self.pos + k.shape[2]
        if end > self.block_size:
            raise UsageError(f"KV cache overflow: {end} positions, room for {self.block_size}")
        if rows != self.batch and not (rows == 1 and self.pos == 0):
            raise UsageError(f"KV cache holds {self.batch} rows, got {rows}")
        kl, vl = self._k[layer], self._v[layer]
        kl[:, :, self.pos : end] = k
        vl[:, :, self.pos : end] = v
        return kl[:rows, :, :end], vl[:rows, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused, not freed)."""
        self.pos = 0


def first_position(cache: KVCache[Any] | None, new: int, block_size: int) -> int:
    """The position of the first of `new` tokens fed after the cached ones (0 without a cache), checked to
    leave the whole sequence inside the model's block_size."""
    start = cache.pos if cache is not None else 0
    if start + new > block_size:
        raise UsageError(
            f"sequence of {start + new} tokens is longer than the model's block_size {block_size}"
        )
    return start
