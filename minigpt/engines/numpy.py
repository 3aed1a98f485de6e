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
Rotary = tuple[np.ndarray, np.ndarray]  # cos and sin of every position's angles, (T, head_dim)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


# --- the computation: minigpt.model's functions in NumPy (inference only: no dropout) ---------------------


def norm(w: NormWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    if w.rms:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(w.eps)) * w.weight
    centred = x - x.mean(-1, keepdims=True)
    y = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + np.float32(w.eps)) * w.weight
    return y if w.bias is None else y + w.bias


def linear(w: LinearWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    # one matrix product over all B*T rows: NumPy multiplies a stacked (B, T, C) array matrix by matrix,
    # reading the whole weight once per row, which made a batch of B single tokens cost B steps
    y = (x.reshape(-1, x.shape[-1]) @ w.weight.T).reshape(*x.shape[:-1], -1)
    return y if w.bias is None else y + w.bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # GPT-2's gelu_new, the same formula as torch's gelu(approximate="tanh")
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rotary(base: float, head_dim: int, start: int, length: int) -> Rotary:
    """cos and sin (length, head_dim) of the rotary angles of positions start..start+length."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inverse = np.float32(1.0) / np.power(np.float32(base), exponents, dtype=np.float32)
    angles = np.arange(start, start + length, dtype=np.float32)[:, None] * inverse[None, :]
    angles = np.concatenate((angles, angles), axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate(x: np.ndarray, rope: Rotary) -> np.ndarray:
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + np.concatenate((-x[..., half:], x[..., :half]), axis=-1) * sin


def attention_mask(queries: int, keys: int, window: int) -> np.ndarray:
    """(queries, keys) booleans, True where a query may see a key: the keys are the latest positions in
    order and the queries the last of them; each sees itself and the window - 1 positions before it."""
    offset = keys - queries
    return np.tri(queries, keys, k=offset, dtype=bool) & ~np.tri(queries, keys, k=offset - window, dtype=bool)


def qkv(
    w: AttentionWeights[np.ndarray], x: np.ndarray, rope: Rotary | None, idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Project x (B, T, C) to queries (B, H, T, hd) and keys and values (B, n_kv_head, T, hd), with
    QK-norm, rotary positions and the value embeddings of the tokens idx applied when the model has them."""
    B, T, C = x.shape
    hd = C // w.n_head
    q, k, v = np.split(linear(w.c_attn, x), [w.n_head * hd, (w.n_head + w.n_kv_head) * hd], axis=-1)
    if w.v_embed is not None:
        v = v + w.v_embed[idx]
    q = q.reshape(B, T, w.n_head, hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, T, w.n_kv_head, hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, w.n_kv_head, hd).transpose(0, 2, 1, 3)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = norm(w.q_norm, q), norm(w.k_norm, k)
    if rope is not None:
        q, k = rotate(q, rope), rotate(k, rope)
    return q, k, v


def attend(
    w: AttentionWeights[np.ndarray],
    x: np.ndarray,
    layer: int,
    cache: Cache | None,
    rope: Rotary | None,
    idx: np.ndarray,
) -> np.ndarray:
    """Causal self-attention of x (B, T, C) over itself and, with a cache, the positions cached before,
    each query seeing at most the layer's window (idx: the tokens, for value embeddings)."""
    B, T, C = x.shape
    q, k, v = qkv(w, x, rope, idx)
    if cache is not None:
        k, v = cache.update(layer, k, v)
    # each key/value head serves a group of consecutive query heads: (B, n_kv_head, group, T, hd)
    q = q.reshape(B, w.n_kv_head, w.n_head // w.n_kv_head, T, -1)
    scores = (q @ k[:, :, None].swapaxes(-1, -2)) * np.float32(1.0 / math.sqrt(q.shape[-1]))
    if T > 1:  # one new query sees every key the cache hands back
        scores[..., ~attention_mask(T, k.shape[2], w.window)] = -np.inf
    y = (softmax(scores) @ v[:, :, None]).reshape(B, w.n_head, T, -1)
    return linear(w.c_proj, y.transpose(0, 2, 1, 3).reshape(B, T, C))


def mlp(w: MLPWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    h = linear(w.c_fc, x)
    if w.activation == "gelu":
        h = gelu_tanh(h)
    elif w.activation == "relu2":
        h = np.square(np.maximum(h, np.float32(0.0)))
    elif w.c_gate is not None:
        h = silu(linear(w.c_gate, x)) * h
    return linear(w.c_proj, h)


def block(
    w: BlockWeights[np.ndarray],
    x: np.ndarray,
    layer: int,
    cache: Cache | None,
    rope: Rotary | None,
    idx: np.ndarray,
) -> np.ndarray:
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache, rope, idx)
    return x + mlp(w.mlp, norm(w.ln_2, x))


def transformer(w: ModelWeights[np.ndarray], idx: np.ndarray, cache: Cache | None) -> np.ndarray:
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones."""
    T = idx.shape[1]
    start = first_position(cache, T, None if w.wpe is None else w.wpe.shape[0])
    x = w.wte[idx]
    rope = None
    if w.wpe is not None:
        x = x + w.wpe[start : start + T]
    if w.rope_base is not None:
        rope = rotary(w.rope_base, w.head_dim, start, T)
    inputs: list[np.ndarray] = []  # the layers' inputs that U-net skips carry to later layers
    takes = {taker: (i, giver) for i, (giver, taker) in enumerate(w.skip_pairs)}
    for layer, b in enumerate(w.h):
        if layer in takes and w.skips is not None:
            i, giver = takes[layer]
            x = x + w.skips[i] * inputs[giver]
        if layer < len(w.skip_pairs):
            inputs.append(x)
        x = block(b, x, layer, cache, rope, idx)
    if cache is not None:
        cache.advance(T)
    return norm(w.ln_f, x)


def head(w: ModelWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The logits of hidden states x: the LM head, soft-capped when the model caps them."""
    logits = x @ w.lm_head.T
    if w.logit_cap is None:
        return logits
    cap = np.float32(w.logit_cap)
    return cap * np.tanh(logits / cap)


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
    quantize = "none"

    def __init__(self, config: GPTConfig, tensors: Mapping[str, np.ndarray]) -> None:
        """`tensors` by GPT-2 name, as a run's weights file holds them (names and shapes checked before)."""
        self.config = config
        self.block_size = config.block_size
        self.rotary = config.pos == "rope"
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
        self.weights = weights_by_name(config, arrays)

    def new_cache(self, batch: int) -> Cache:
        c = self.config
        shapes = [(batch, c.kv_heads, window, c.head_dim) for window in c.layer_windows]
        keys = [np.zeros(s, dtype=np.float32) for s in shapes]
        values = [np.zeros(s, dtype=np.float32) for s in shapes]
        return KVCache(keys, values, c.block_size if c.pos == "learned" else None, np.concatenate)

    def forward(self, ids: Sequence[Sequence[int]], cache: Cache | None) -> np.ndarray:
        x = transformer(self.weights, np.asarray(ids, dtype=np.int64), cache)
        logits = head(self.weights, x[:, -1])
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
