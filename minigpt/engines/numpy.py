"""The NumPy engine: model.py's forward pass, block by block, in float32 NumPy on the CPU, without torch.

`import torch` alone takes 2-3 s on a small CPU machine, longer than generating a few hundred tokens from
a small model, so `minigpt generate` runs float32 CPU generation here and starts in a fraction of a second.
Each function mirrors the one of the same name in `minigpt.model`, over the same `ModelWeights` tree;
tests hold its logits to GPT.forward and its greedy tokens to the torch engine's. Random draws come from
NumPy's PCG64, so a seed reproduces text on this engine (the torch engine's generator gives other text).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from minigpt.config import GPTConfig
from minigpt.kvcache import KVCache, first_position
from minigpt.weights import (
    AttentionWeights,
    BlockWeights,
    LinearWeights,
    MLPWeights,
    ModelWeights,
    NormWeights,
    weights_by_name,
)

__all__ = ["NumpyEngine", "sample_next"]

Cache = KVCache[np.ndarray]
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


# --- the computation: minigpt.model's functions in NumPy (inference only: no dropout) ---------------------


def norm(w: NormWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    centred = x - x.mean(-1, keepdims=True)
    y = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + np.float32(w.eps)) * w.weight
    return y if w.bias is None else y + w.bias


def linear(w: LinearWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    y = x @ w.weight.T
    return y if w.bias is None else y + w.bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # GPT-2's gelu_new, the same formula as torch's gelu(approximate="tanh")
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def causal_mask(queries: int, past: int) -> np.ndarray:
    """(queries, past + queries) booleans, True where the query at position past+i may see the key."""
    return np.tri(queries, past + queries, k=past, dtype=bool)


def qkv(w: AttentionWeights[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Project x (B, T, C) to per-head queries, keys and values, each a (B, H, T, hd) view."""
    B, T, C = x.shape
    q, k, v = linear(w.c_attn, x).reshape(B, T, 3, w.n_head, C // w.n_head).transpose(2, 0, 3, 1, 4)
    return q, k, v


def attend(w: AttentionWeights[np.ndarray], x: np.ndarray, layer: int, cache: Cache | None) -> np.ndarray:
    """Causal self-attention of x (B, T, C) over itself and, with a cache, every position cached before."""
    B, T, C = x.shape
    q, k, v = qkv(w, x)
    past = 0
    if cache is not None:
        past = cache.pos
        k, v = cache.update(layer, k, v)
    scores = (q @ k.swapaxes(-1, -2)) * np.float32(1.0 / math.sqrt(q.shape[-1]))
    if T > 1:  # one new query may look at every cached key
        scores[..., ~causal_mask(T, past)] = -np.inf
    y = softmax(scores) @ v
    return linear(w.c_proj, y.transpose(0, 2, 1, 3).reshape(B, T, C))


def mlp(w: MLPWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    return linear(w.c_proj, gelu_tanh(linear(w.c_fc, x)))


def block(w: BlockWeights[np.ndarray], x: np.ndarray, layer: int, cache: Cache | None) -> np.ndarray:
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache)
    return x + mlp(w.mlp, norm(w.ln_2, x))


def transformer(w: ModelWeights[np.ndarray], idx: np.ndarray, cache: Cache | None) -> np.ndarray:
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones."""
    T = idx.shape[1]
    start = first_position(cache, T, w.wpe.shape[0])
    x = w.wte[idx] + w.wpe[start : start + T]
    for layer, b in enumerate(w.h):
        x = block(b, x, layer, cache)
    if cache is not None:
        cache.advance(T)
    return norm(w.ln_f, x)


# --- sampling -------------------------------------------------------------------------------------------


def sample_next(
    logits: np.ndarray,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Next-token ids (B,) from logits (B, V), by the rules of `Engine.sample` (the torch engine's)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / temperature
    rows, vocab = z.shape
    if top_k is not None and top_k < vocab:
        keep = np.argpartition(z, vocab - top_k, axis=-1)[:, vocab - top_k :]
        cut = np.full_like(z, -np.inf)
        np.put_along_axis(cut, keep, np.take_along_axis(z, keep, -1), -1)
        z = cut
    if top_p is not None and top_p < 1:
        order = np.argsort(-z, axis=-1, kind="stable")
        ranked = np.take_along_axis(z, order, -1)
        p = softmax(ranked)
        ranked[np.cumsum(p, -1) - p >= top_p] = -np.inf  # the tokens ranked above already reach top_p
        np.put_along_axis(z, order, ranked, -1)
    cdf = np.cumsum(softmax(z), -1)
    u = rng.random(rows) * cdf[:, -1]
    # side="right" never lands on a zero-probability token: its cdf step is empty
    picks = [np.searchsorted(cdf[r], u[r], side="right") for r in range(rows)]
    return np.minimum(np.array(picks, dtype=np.int64), vocab - 1)


class NumpyEngine:
    """GPT weights in float32 NumPy as the decode loop's Engine (the CPU, float32 only)."""

    name = "numpy"
    device = "cpu"
    dtype = "float32"

    def __init__(self, config: GPTConfig, tensors: Mapping[str, np.ndarray]) -> None:
        """`tensors` by GPT-2 name, as a run's weights file holds them (names and shapes checked before)."""
        self.config = config
        self.block_size = config.block_size
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
        self.weights = weights_by_name(config, arrays)

    def new_cache(self, batch: int) -> Cache:
        c = self.config
        shape = (c.n_layer, batch, c.n_head, c.block_size, c.head_dim)
        return KVCache(np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32))

    def forward(self, ids: Sequence[Sequence[int]], cache: Cache | None) -> np.ndarray:
        x = transformer(self.weights, np.asarray(ids, dtype=np.int64), cache)
        logits = x[:, -1] @ self.weights.lm_head.T
        return logits if cache is None else np.broadcast_to(logits, (cache.batch, logits.shape[-1]))

    def sample(
        self,
        logits: np.ndarray,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        rng: np.random.Generator,
    ) -> list[int]:
        return sample_next(logits, temperature, top_k, top_p, rng).tolist()

    def rng(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)
