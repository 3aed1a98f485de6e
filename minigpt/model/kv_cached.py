"""The KV-cached path on the torch model: a forward pass over new tokens placed after cached ones (no I/O).

Decoding feeds the model a few tokens at a time; each layer stores their keys and values in the cache
(`minigpt.model.kvcache`, which the NumPy engine shares) and attends over every position the cache keeps,
so the earlier tokens are never computed again. The default path joins it at two points: `gpt.embed` reads
the new tokens' positions from `positions`, and `gpt.attend` swaps a layer's new keys and values for the
cached ones through `cached_keys`. The cache may hold them in float16 (`as_cached`), and its rows may stand
at different positions (a server's joined requests), each taking one token a step and seeing only the
slots it has filled.
"""

from __future__ import annotations

import numpy as np
import torch

from minigpt.model.config import GPTConfig
from minigpt.model.kvcache import KVCache, position_ids

Cache = KVCache[torch.Tensor]


def new_cache(
    config: GPTConfig, like: torch.Tensor, batch: int, dtype: torch.dtype | None, capacity: int | None = None
) -> Cache:
    """An empty KV cache of `batch` rows, each layer as long as its window or `capacity` if shorter, in
    `dtype` (None: `like`'s) on `like`'s device."""
    shapes = [
        (batch, config.kv_heads, min(window, capacity or window), config.head_dim)
        for window in config.layer_windows
    ]
    keys, values = (
        [like.new_zeros(s, dtype=dtype) for s in shapes],
        [like.new_zeros(s, dtype=dtype) for s in shapes],
    )
    return KVCache(keys, values, config.block_size if config.pos == "learned" else None, torch.cat)


def positions(start: int | np.ndarray, new: int, device: torch.device) -> slice | torch.Tensor:
    """Where `new` tokens from `start` (`kvcache.first_position`'s answer) stand, as an index into a table
    of positions: a slice where the rows share their positions, else each row's own (B, 1)."""
    if isinstance(start, int):
        return slice(start, start + new)
    return row_positions(start, new, device)


def row_positions(start: np.ndarray, new: int, device: torch.device) -> torch.Tensor:
    """The (B, 1) positions of rows standing at different positions, one new token each."""
    return torch.from_numpy(position_ids(start, new)).to(device)


def as_cached(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New keys and values in a cache's type: float16 rounds them (clamped to its largest finite value
    first, so that a huge key is a large score rather than inf), as
    `minigpt.generate.engines.numpy_engine.as_cached`."""
    if dtype == k.dtype:
        return k, v
    if dtype == torch.float16:
        top = torch.finfo(torch.float16).max
        k, v = k.clamp(-top, top), v.clamp(-top, top)
    return k.to(dtype), v.to(dtype)


def cached_keys(
    cache: Cache, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Store a layer's new keys and values (B, n_kv_head, T, hd) and return the keys and values its queries
    attend to, in the queries' `dtype`, with the slots each row may see where the rows stand at different
    positions ((B, 1, 1, keys) booleans; else None: all of them)."""
    k, v = cache.update(layer, *as_cached(cache.k[layer].dtype, k, v))
    seen = cache.key_mask(layer)
    mask = None if seen is None else torch.from_numpy(seen).to(k.device)[:, None, None, :]
    return k.to(dtype), v.to(dtype), mask
