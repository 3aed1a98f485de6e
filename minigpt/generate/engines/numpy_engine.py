"""The NumPy engine: minigpt.model.gpt's forward pass, block by block, in float32 NumPy on the CPU, without torch.

Importing torch takes longer than generating a few hundred tokens from a small model on a small CPU
machine, so `minigpt generate` runs float32 CPU generation here, where start-up is NumPy's import.
Each function mirrors the one of the same name in `minigpt.model.gpt`, or in the variant module it calls
there (`rotary`, `scores`, `kv_cached`), over the same `ModelWeights` tree; tests hold its logits to
GPT.forward and its greedy tokens to the torch engine's. Random draws come from NumPy's PCG64, so a seed
reproduces text on this engine (the torch engine's generator gives other text).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from minigpt.errors import UsageError
from minigpt.generate.config import KV_CACHES
from minigpt.generate.engines import kernels as _kernels
from minigpt.generate.engines.tuning import best_times, blas_tuner, model_key, pick_layout, remembered
from minigpt.model.config import GPTConfig
from minigpt.model.kvcache import KVCache, first_position, gather_rows, position_ids
from minigpt.model.memory import available_bytes, inference_bytes, score_chunks
from minigpt.model.weights import (
    QUANTIZATIONS,
    AttentionWeights,
    BlockWeights,
    LinearWeights,
    MLPWeights,
    ModelWeights,
    NormWeights,
    for_decoding,
    map_linears,
    weights_by_name,
)

__all__ = ["LAYOUTS", "NumpyEngine", "int8_linear", "log_softmax", "packed", "sample_next"]

Cache = KVCache[np.ndarray]
Rotary = tuple[np.ndarray, np.ndarray]  # cos and sin of every position's angles, (T, head_dim)
Product = Callable[[LinearWeights[np.ndarray], np.ndarray], np.ndarray]  # x (..., in) through a layer
# whether to load the kernels now, for (quantize, kv_cache): yes, no, or not yet, and when (`NumpyEngine`)
Plan = Callable[[str, str], tuple[bool, Callable[[], bool] | None]]
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
T = TypeVar("T")


# --- the computation: minigpt.model.gpt's functions in NumPy (inference only: no dropout) ---------------------
# Written for a decoding step's few hundred small operations: reductions through the ufuncs themselves
# (ndarray.mean is a Python wrapper), results updated in place where that spares a temporary.


def _reduce_mean(x: np.ndarray) -> np.ndarray:
    return np.add.reduce(x, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])


def norm(w: NormWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    if not w.rms:
        x = x - _reduce_mean(x)
    scale = _reduce_mean(x * x)
    scale += np.float32(w.eps)
    np.sqrt(scale, out=scale)
    y = x / scale
    y *= w.weight
    if w.bias is not None:
        y += w.bias
    return y


def linear(w: LinearWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
    # one matrix product over all B*T rows: NumPy multiplies a stacked (B, T, C) array matrix by matrix,
    # reading the whole weight once per row, which would make a batch of B single tokens cost B steps
    if w.weight.ndim >= 3:  # bands (`banded`, `quantized_bands`): only the kernels read them
        y = _kernels.matvec(w, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    weight = w.weight
    if w.scale is not None:  # int8 rows (output-major): a prefill's products take them dequantized
        weight = weight.astype(np.float32) * w.scale[:, None]
    y = x.reshape(-1, x.shape[-1]) @ (weight if w.input_major else weight.T)
    if w.bias is not None:
        y += w.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    # GPT-2's gelu_new, torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(u)) = x sigmoid(2u) with
    # u = c (x + a x³), the form with the fewest operations
    e = x * x
    e *= np.float32(-2.0 * 0.044715) * _GELU_C
    e -= np.float32(2.0) * _GELU_C
    e *= x
    np.exp(e, out=e)
    e += np.float32(1.0)
    return np.divide(x, e, out=e)


def silu(x: np.ndarray) -> np.ndarray:
    e = np.negative(x)
    np.exp(e, out=e)
    e += np.float32(1.0)
    return np.divide(x, e, out=e)


def softmax(x: np.ndarray) -> np.ndarray:
    e = x - np.maximum.reduce(x, axis=-1, keepdims=True)
    np.exp(e, out=e)
    e /= np.add.reduce(e, axis=-1, keepdims=True)
    return e


def inverse_frequencies(base: float, head_dim: int) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return np.float32(1.0) / np.power(np.float32(base), exponents, dtype=np.float32)


def rotary(base: float, head_dim: int, start: int, length: int, inverse: np.ndarray | None = None) -> Rotary:
    """cos and sin (length, head_dim) of the rotary angles of positions start..start+length (`inverse`:
    the frequencies, `inverse_frequencies(base, head_dim)`, when the caller keeps them), the first half
    of sin negated, as `rotate` applies it."""
    return rotary_at(base, head_dim, np.arange(start, start + length), inverse)


def rotary_at(base: float, head_dim: int, positions: np.ndarray, inverse: np.ndarray | None = None) -> Rotary:
    """`rotary` at any positions (an integer array): cos and sin of shape positions.shape + (head_dim,)."""
    inverse = inverse_frequencies(base, head_dim) if inverse is None else inverse
    angles = positions.astype(np.float32)[..., None] * inverse
    angles = np.concatenate((angles, angles), axis=-1)
    sin = np.sin(angles)
    sin[..., : head_dim // 2] *= np.float32(-1.0)
    return np.cos(angles), sin


class RotaryTable:
    """`rotary`'s rows for any positions, computed CHUNK positions at a time and kept: a decoding step's
    one row is then a slice, where computing it would be several NumPy calls a token, each starting from
    caches a step's weights have just streamed through. The values are `rotary`'s (each row depends only on
    its position). One chunk is kept, as a tuple read and replaced whole (a server's threads may share it);
    decoding past it computes the next."""

    CHUNK = 256

    def __init__(self, base: float, head_dim: int) -> None:
        self.base, self.head_dim = base, head_dim
        self.inverse = inverse_frequencies(base, head_dim)
        self._kept: tuple[int, np.ndarray, np.ndarray] = (0, *rotary(base, head_dim, 0, 0, self.inverse))

    def __call__(self, start: int, length: int) -> Rotary:
        first, cos, sin = self._kept
        if not first <= start <= start + length <= first + len(cos):
            first = start
            cos, sin = rotary(self.base, self.head_dim, start, max(length, self.CHUNK), self.inverse)
            self._kept = (first, cos, sin)
        return cos[start - first : start - first + length], sin[start - first : start - first + length]

    def at(self, positions: np.ndarray) -> Rotary:
        """The rows of any positions (rows standing at different positions: one each)."""
        return rotary_at(self.base, self.head_dim, positions, self.inverse)


def rotate(x: np.ndarray, rope: Rotary) -> np.ndarray:
    cos, sin = rope  # sin's first half negated (`rotary`): the turned half is (-x2, x1)
    half = x.shape[-1] // 2
    turned = np.concatenate((x[..., half:], x[..., :half]), axis=-1)
    turned *= sin
    turned += x * cos
    return turned


def attention_mask(queries: int, keys: int, window: int) -> np.ndarray:
    """(queries, keys) booleans, True where a query may see a key: the keys are the latest positions in
    order and the queries the last of them; each sees itself and the window - 1 positions before it."""
    offset = keys - queries
    return np.tri(queries, keys, k=offset, dtype=bool) & ~np.tri(queries, keys, k=offset - window, dtype=bool)


def qkv(
    w: AttentionWeights[np.ndarray],
    x: np.ndarray,
    rope: Rotary | None,
    idx: np.ndarray | None = None,
    product: Product = linear,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Project x (B, T, C) to queries (B, H, T, hd) and keys and values (B, n_kv_head, T, hd), with
    QK-norm, rotary positions and the value embeddings of the tokens idx applied when the model has them
    (`product`: how x goes through a linear layer, here and in `attend`, `mlp`, `block`)."""
    B, T, C = x.shape
    H, kv = w.n_head, w.n_kv_head
    heads = product(w.c_attn, x).reshape(B, T, H + 2 * kv, C // H)  # a new array: changed in place
    if w.score == "general":  # W acts on the projected queries, so it folds into W_Q: (B, T, H, 1, hd)
        heads[:, :, :H] = (heads[:, :, :H, None] @ w.score_maps[0].swapaxes(-1, -2))[:, :, :, 0]
    if w.v_embed is not None and idx is not None:
        heads[:, :, -kv:] += w.v_embed[idx].reshape(B, T, kv, -1)
    if w.q_norm is not None and w.k_norm is not None:
        heads[:, :, :H] = norm(w.q_norm, heads[:, :, :H])
        heads[:, :, H:-kv] = norm(w.k_norm, heads[:, :, H:-kv])
    if rope is not None:  # queries and keys turn together: (B, T, heads, hd) by (T, 1, hd) or (B, T, 1, hd)
        cos, sin = rope
        heads[:, :, :-kv] = rotate(heads[:, :, :-kv], (cos[..., None, :], sin[..., None, :]))
    heads = heads.transpose(0, 2, 1, 3)
    return heads[:, :H], heads[:, H:-kv], heads[:, -kv:]


def attention_logits(w: AttentionWeights[np.ndarray], q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Logits (B, n_kv_head, group * T, S) of the queries q (B, H, T, hd) over the keys k (B, n_kv_head,
    S, hd) by the layer's score: q·k/√hd, q·k (dot; general, whose W qkv applied), or additive's
    vᵀtanh(W₁q + W₂k), left -inf where no query of a chunk may look (the caller masks the rest).

    The queries of a key/value head's group and of every new position share its keys: the dot-product
    scores take one product per (row, key/value head) for all of them."""
    B, H, T, hd = q.shape
    kv = k.shape[1]
    if w.score == "additive":
        logits = _additive_logits(w, q.reshape(B, kv, H // kv, T, hd), k[:, :, None])
        return logits.reshape(B, kv, -1, k.shape[2])
    if w.score == "scaled":
        q = q * np.float32(1.0 / math.sqrt(hd))
    return q.reshape(B, kv, H // kv * T, hd) @ k.swapaxes(-1, -2)


def _additive_logits(w: AttentionWeights[np.ndarray], q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """vᵀtanh(W₁q + W₂k) (B, n_kv_head, group, T, S) of the queries q (B, n_kv_head, group, T, hd) over
    the keys k (B, n_kv_head, 1, S, hd), a chunk of queries at a time (`memory.score_chunks`)."""
    # each head's maps, grouped as the queries are: (n_kv_head, group, out, in)
    w1, w2, v = (m.reshape(q.shape[1], q.shape[2], *m.shape[1:]) for m in w.score_maps)
    qa, ka = q @ w1.swapaxes(-1, -2), k @ w2.swapaxes(-1, -2)  # (B, n_kv, group, T or S, d_a)
    B, G, T, S = q.shape[0], q.shape[2], q.shape[3], k.shape[3]
    logits = np.full((B, q.shape[1], G, T, S), -np.inf, dtype=np.float32)
    for t0, t1, k0, k1 in score_chunks(T, S, w.window, B * w.n_head * qa.shape[-1]):
        pre = qa[..., t0:t1, None, :] + ka[..., None, k0:k1, :]  # the memory score_chunks bounds
        logits[..., t0:t1, k0:k1] = (np.tanh(pre, out=pre) @ v[:, :, None].swapaxes(-1, -2))[..., 0]
    return logits


F16_LARGEST = np.float32(np.finfo(np.float16).max)


def as_cached(dtype: np.dtype, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New keys and values in a cache's type: rounded to float16 for a float16 cache (clamped to its
    largest finite value first, as the kernels store them), as they are for a float32 one."""
    if dtype == np.float32:
        return k, v
    return tuple(np.clip(t, -F16_LARGEST, F16_LARGEST).astype(dtype) for t in (k, v))  # type: ignore[return-value]


def attend(
    w: AttentionWeights[np.ndarray],
    x: np.ndarray,
    layer: int,
    cache: Cache | None,
    rope: Rotary | None,
    idx: np.ndarray | None = None,
    product: Product = linear,
) -> np.ndarray:
    """Causal self-attention of x (B, T, C) over itself and, with a cache, the positions cached before,
    each query seeing at most the layer's window (idx: the tokens, for value embeddings)."""
    B, T, C = x.shape
    q, k, v = qkv(w, x, rope, idx, product)
    seen = None
    if cache is not None:
        k, v = cache.update(layer, *as_cached(cache.k[layer].dtype, k, v))
        seen = cache.key_mask(layer)
    group = w.n_head // w.n_kv_head
    scores = attention_logits(w, q, k)  # (B, n_kv_head, group * T, S)
    if T > 1:  # one new query sees every key the cache hands back
        by_position = scores.reshape(B, w.n_kv_head, group, T, -1)
        by_position[..., ~attention_mask(T, k.shape[2], w.window)] = -np.inf
    elif seen is not None:  # rows at different positions: each sees the slots it has filled
        scores = np.where(seen[:, None, None, :], scores, np.float32(-np.inf))
    y = (softmax(scores) @ v).reshape(B, w.n_head, T, -1)
    return product(w.c_proj, y.transpose(0, 2, 1, 3).reshape(B, T, C))


def mlp(w: MLPWeights[np.ndarray], x: np.ndarray, product: Product = linear) -> np.ndarray:
    h = product(w.c_fc, x)
    if w.activation == "gelu":
        h = gelu_tanh(h)
    elif w.activation == "relu2":
        h = np.maximum(h, np.float32(0.0), out=h)
        h *= h
    elif w.fused_gate:
        half = h.shape[-1] // 2
        gate = silu(h[..., :half])
        gate *= h[..., half:]
        h = gate
    elif w.c_gate is not None:
        h = silu(product(w.c_gate, x)) * h
    return product(w.c_proj, h)


def block(
    w: BlockWeights[np.ndarray],
    x: np.ndarray,
    layer: int,
    cache: Cache | None,
    rope: Rotary | None,
    idx: np.ndarray | None = None,
    product: Product = linear,
) -> np.ndarray:
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache, rope, idx, product)
    x += mlp(w.mlp, norm(w.ln_2, x), product)
    return x


class KernelCache(KVCache[np.ndarray]):
    """A KV cache whose layers' keys and values lie in one buffer (`arena`), with where each starts, made
    once, as the kernels take it (`kernels.cache_args`)."""

    def __init__(self, k: Sequence[np.ndarray], v: Sequence[np.ndarray], limit: int | None) -> None:
        super().__init__(k, v, limit, np.concatenate)
        self.kernel = _kernels.cache_args(k, v)


def transformer(
    w: ModelWeights[np.ndarray],
    idx: np.ndarray,
    cache: Cache | None,
    angles: Callable[[int, int], Rotary] | None = None,
    block: Callable[..., np.ndarray] = block,
) -> np.ndarray:
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones, each
    layer computed by `block` (`kernels.model_step` is this and `head` for a one-token step); a rotary
    model's angles from `angles(start, T)` (a `RotaryTable`; None: computed here)."""
    T = idx.shape[1]
    start = first_position(cache, T, None if w.wpe is None else w.wpe.shape[0])
    if idx.size and idx.min() < 0:  # NumPy would take a negative id from the end of the table
        raise IndexError("token id outside the vocabulary")
    x = w.wte[idx]
    rope = None
    if w.wpe is not None:
        x += w.wpe[position_ids(start, T)]
    if w.rope_base is not None and isinstance(start, np.ndarray):  # rows at different positions
        rope = rotary_at(w.rope_base, w.head_dim, position_ids(start, T))
    elif w.rope_base is not None:
        rope = rotary(w.rope_base, w.head_dim, start, T) if angles is None else angles(start, T)
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


def head(
    w: ModelWeights[np.ndarray],
    lm_head: LinearWeights[np.ndarray],
    x: np.ndarray,
    product: Product = linear,
) -> np.ndarray:
    """The logits of hidden states x: the LM head (`lm_head`, in the engine's layout, applied by
    `product`), soft-capped when the model caps them."""
    logits = product(lm_head, x)
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
    *,
    compiled: bool = False,
) -> np.ndarray:
    """Next-token ids (B,) from logits (B, V), by the rules of `Engine.sample` (the torch engine's);
    `compiled`: without top-k and top-p, by the kernels' draw (the same tokens, in one call)."""
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is None and top_p is None and compiled:  # the common case, compiled
        return _kernels.draw(logits, temperature, rng.random(logits.shape[0]))
    # shifted to a largest of 0 before dividing: a tiny temperature (1e-320) gives 0 and -inf, never NaN
    z = np.subtract(logits, np.maximum.reduce(logits, axis=-1, keepdims=True), dtype=np.float64)
    with np.errstate(over="ignore"):  # -inf is the weight 0 it stands for
        z /= temperature
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
    # the weights exp(z - max), not divided by their sum: u is drawn over their total, which spares a
    # NumPy call (each starts cold, after a step's weights have streamed through the caches)
    z -= np.maximum.reduce(z, axis=-1, keepdims=True)  # top-k and top-p may have cut the largest
    cdf = np.cumsum(np.exp(z, out=z), -1)
    u = rng.random(rows) * cdf[:, -1]
    # side="right" never lands on a zero-probability token: its cdf step is empty
    picks = [np.searchsorted(cdf[r], u[r], side="right") for r in range(rows)]
    return np.minimum(np.array(picks, dtype=np.int64), vocab - 1)


LAYOUTS = ("auto", "output-major", "input-major")
# the batches the kernels' tiling is measured at (`NumpyEngine._pick_tiles`): the first's answer serves
# steps of fewer rows than the second, the second's steps of as many or more (a server's wide batches)
TILE_ROWS = (8, 16)
# the batches the bands' prefetch distances are measured at (`NumpyEngine._pick_prefetch`): the row counts
# the band kernels sum at once, the widest's answer serving every wider batch and a prefill
FETCH_ROWS = (1, 2, 4, 8)
PREFILL_PROBES = (16, 128, 512)  # rows a prefill's products are timed at (`NumpyEngine._pick_kernel_rows`)
PREFETCH_ENV = "MINIGPT_PREFETCH"  # fixes the bands' prefetch distances for every batch, untimed
PREFETCH_MOST = 1 << 20  # a distance past a megabyte would ask for lines long evicted before their use


def prefetch_setting(value: str) -> tuple[int, int]:
    """A prefetch distance as PREFETCH_ENV or an engine's `prefetch` names it: one of `kernels.PREFETCHES`
    (none, 2k, 1k/8k, ...), or two byte distances NEAR,FAR (0 < NEAR, 0 <= FAR, each at most
    PREFETCH_MOST; FAR 0: the near line only)."""
    if value in _kernels.PREFETCHES:
        return _kernels.PREFETCHES[value]
    parts = value.replace(" ", "").split(",")
    if len(parts) == 2 and all(p.isdigit() and len(p) < 10 for p in parts):
        near, far = int(parts[0]), int(parts[1])
        if 0 < near <= PREFETCH_MOST and far <= PREFETCH_MOST:
            return near, far
    raise UsageError(
        f"unknown prefetch distance {value!r} (set by {PREFETCH_ENV} or the engine): name one of "
        f"{', '.join(_kernels.PREFETCHES)}, or give two byte distances NEAR,FAR (NEAR from 1, each at most "
        f"{PREFETCH_MOST}), e.g. 2048,16384"
    )


def prefetch_label(ahead: tuple[int, int]) -> str:
    """A prefetch distance's name in `kernels.PREFETCHES`, else NEAR,FAR."""
    return next((name for name, a in _kernels.PREFETCHES.items() if a == ahead), f"{ahead[0]},{ahead[1]}")


def _at(choices: Mapping[int, T], rows: int) -> T:
    """The choice made for the widest batch of `choices` no wider than `rows` (the narrowest's below)."""
    wide = [r for r in choices if r <= rows]
    return choices[max(wide) if wide else min(choices)]


def transposed(a: np.ndarray, chunk: int = 128) -> np.ndarray:
    """A C-contiguous copy of a.T, written `chunk` rows of `a` at a time: a plain copy strides through
    memory column by column, touching a new cache line at every element it writes."""
    out = np.empty(a.shape[::-1], dtype=a.dtype)
    for i in range(0, a.shape[0], chunk):
        out[:, i : i + chunk] = a[i : i + chunk].T
    return out


def bf16_rounded(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = a.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def int8_linear(w: LinearWeights[np.ndarray]) -> LinearWeights[np.ndarray]:
    """One output-major linear layer as int8 rows with one symmetric scale each: `minigpt.model.quantize`'s
    rule (scale = max |w| / 127 of the row, rounded to bfloat16 first, then w / scale rounded to nearest),
    so both engines run the same int8 weights (tested)."""
    tiny = np.finfo(np.float32).tiny
    scale = bf16_rounded(np.maximum(np.abs(w.weight).max(axis=1) / np.float32(127), tiny))
    q = np.clip(np.rint(w.weight / scale[:, None]), -127, 127).astype(np.int8)
    return LinearWeights(q, w.bias, scale)


def banded(w: LinearWeights[np.ndarray]) -> LinearWeights[np.ndarray]:
    """An output-major linear layer (float32 or int8 rows) as bands of `kernels.LANES` consecutive
    outputs, each input-major: (out / LANES, in, LANES), what the kernels' products read
    (`kernels._band_sums`); a view of the rows, which `packed` lays out contiguously.

    Within a band an input's LANES weights are adjacent, one 64-byte load that the kernels multiply into
    every row's LANES sums at once, where output-major rows would leave each output a sum across a
    vector's lanes to finish."""
    n_out, n_in = w.weight.shape
    bands = w.weight.reshape(n_out // _kernels.LANES, _kernels.LANES, n_in).transpose(0, 2, 1)
    # a view: `packed` writes it out in this order, so the engine's load makes no copy of its own
    return dataclasses.replace(w, weight=bands)


def quantized_bands(w: LinearWeights[np.ndarray]) -> LinearWeights[np.ndarray]:
    """An int8 linear layer (`int8_linear`'s rows and scales) as the kernels' int8 bands (`kernels._qbands`):
    (out / LANES, in / 4, LANES, 4) uint8, each group of four inputs the LANES outputs' four weights,
    each plus 128 (a byte dot-product instruction multiplies unsigned bytes by signed ones, and the
    activations are the signed ones); the outputs padded to whole bands and the inputs to whole QBLOCKs
    with zero weights (128). The scales and bias are kept: they give the true number of outputs.

    A band's weights are read in order, 64 bytes a group, each group multiplied into every row's LANES
    int32 sums by one instruction per row."""
    lanes, block = _kernels.LANES, _kernels.QBLOCK
    n_out, n_in = w.weight.shape
    bytes_ = np.full((-(-n_out // lanes) * lanes, -(-n_in // block) * block), 128, dtype=np.uint8)
    bytes_[:n_out, :n_in] = w.weight.astype(np.int16) + 128
    groups = bytes_.reshape(len(bytes_) // lanes, lanes, bytes_.shape[1] // 4, 4).transpose(0, 2, 1, 3)
    return dataclasses.replace(w, weight=groups)  # a view: `packed` writes it out in this order


def can_band(weights: ModelWeights[np.ndarray]) -> bool:
    """Whether every block's linear layers have a multiple of `kernels.LANES` outputs (every model whose
    widths are multiples of 16; the others keep their rows)."""
    outs: list[int] = []

    def count(w: LinearWeights[np.ndarray]) -> LinearWeights[np.ndarray]:
        outs.append(_kernels.out_features(w))
        return w

    map_linears(weights.h, count)
    return all(n % _kernels.LANES == 0 for n in outs)


def _transposed(weights: ModelWeights[np.ndarray]) -> ModelWeights[np.ndarray]:
    return for_decoding(weights, np.concatenate, transposed)


def arena(shapes: Sequence[tuple[int, ...]], dtype: np.dtype | type, zeros: bool = False) -> list[np.ndarray]:
    """Arrays of these shapes, each a view of one buffer (in order, each starting on a 64-byte cache line):
    one allocation that reaches NumPy's 4 MB threshold for transparent huge pages where its parts would
    not (`packed`, `NumpyEngine.new_cache`). `zeros`: filled with zeros (pages the kernel maps on first
    touch), else uninitialised."""
    dtype = np.dtype(dtype)
    align = 64 // dtype.itemsize  # elements
    sizes = [-(-math.prod(s) // align) * align for s in shapes]
    buffer = (np.zeros if zeros else np.empty)(sum(sizes) + align, dtype=dtype)
    start = (-buffer.ctypes.data % 64) // dtype.itemsize  # malloc aligns to 16 bytes only
    views = []
    for shape, size in zip(shapes, sizes, strict=True):
        views.append(buffer[start : start + math.prod(shape)].reshape(shape))
        start += size
    return views


def packed(
    weights: ModelWeights[np.ndarray], lm_head: LinearWeights[np.ndarray]
) -> tuple[ModelWeights[np.ndarray], LinearWeights[np.ndarray]]:
    """The tree and head with every array moved into one buffer of its dtype (float32, and int8 for
    quantized weights), in the order a step reads them (the same values; each array a view of its buffer;
    a tied head and the embeddings one copy).

    NumPy asks Linux for transparent huge pages for an allocation of 4 MB or more (madvise), which no
    matrix of a small model reaches: its weights would lie on thousands of 4 KB pages, and a step that
    streams them would miss the TLB at each; one buffer can lie on 2 MB pages. And the kernels are
    handed the buffers and where each tensor lies in them (`kernels.model_args`), not a hundred arrays at
    each step.
    """
    arrays: dict[int, np.ndarray] = {}
    _collect((weights, lm_head), arrays)
    views: dict[int, np.ndarray] = {}
    for dtype in dict.fromkeys(a.dtype for a in arrays.values()):
        group = {key: a for key, a in arrays.items() if a.dtype == dtype}
        for (key, a), view in zip(
            group.items(), arena([a.shape for a in group.values()], dtype), strict=True
        ):
            view[...] = a
            views[key] = view
    return _rebuilt(weights, views), _rebuilt(lm_head, views)


def _collect(node: object, arrays: dict[int, np.ndarray]) -> None:
    """Every array of a weight tree (dataclasses and tuples), by id, in the order of the fields."""
    if isinstance(node, np.ndarray):
        arrays.setdefault(id(node), node)
    elif isinstance(node, tuple):
        for item in node:
            _collect(item, arrays)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            _collect(getattr(node, field.name), arrays)


def _rebuilt(node: T, views: dict[int, np.ndarray]) -> T:
    """The tree with each array replaced by its view (`views`, by the array's id)."""
    if isinstance(node, np.ndarray):
        return views[id(node)]  # type: ignore[return-value]
    if isinstance(node, tuple):
        return tuple(_rebuilt(item, views) for item in node)  # type: ignore[return-value]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = {f.name: _rebuilt(getattr(node, f.name), views) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **fields)  # type: ignore[return-value]
    return node


def _decoding_tree(
    config: GPTConfig, tensors: Mapping[str, np.ndarray], layout: str, kernels: bool | None, quantize: str
) -> tuple[ModelWeights[np.ndarray], str, bool]:
    """The tree a NumPy engine decodes with (float32, SwiGLU's two input products fused, the blocks' linear
    layers int8 when `quantize` says so), the layout still to settle (`pick_layout`: the kernels' and int8's
    is output-major, untimed), and whether the kernels run it (`kernels` None: where they can)."""
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if quantize not in QUANTIZATIONS:
        raise UsageError(f"unknown quantization {quantize!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if kernels and not _kernels.available():
        raise UsageError("the compiled decoding kernels need numba: pip install numba")
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    fused = for_decoding(weights_by_name(config, arrays), np.concatenate)
    if quantize == "int8":  # int8 rows are output-major: there is no other layout to time
        if layout == "input-major":
            raise UsageError("int8 weights are held output-major: use layout output-major or auto")
        fused, layout = dataclasses.replace(fused, h=map_linears(fused.h, int8_linear)), "output-major"
    use_kernels = kernels is not False and _kernels.available() and all(map(_kernels.supported, fused.h))
    if use_kernels and layout == "auto":
        layout = "output-major"  # the kernels' layout: no timing, no transposed copies
    return fused, layout, use_kernels


class NumpyEngine:
    """GPT weights in NumPy as the decode loop's Engine (the CPU; float32, or int8 linear layers).

    A one-token step over a cache runs as one compiled call (`minigpt.generate.engines.kernels`, where
    numba is installed and `kernels` is not False; the blocks' matrices held as `banded` copies of the
    file's (out, in) ones where every width is a multiple of 16, else as they are), and so does a prefill
    the cache holds without wrapping: any length with bands, else up to `kernel_rows` tokens (16 at
    least; measured at load: `_pick_kernel_rows`); other prefills and the attention scores the kernels
    lack run as NumPy array operations, a prefill's matrix products through the kernels (bands; rows up
    to `kernel_rows`). Without the kernels the weights are held in the form BLAS's matrix products
    stream fastest on this machine: `layout`
    'output-major' keeps the file's (out, in) matrices, 'input-major' holds transposed copies, and 'auto'
    times a one-token step in each and keeps the faster (the file is never changed); with them 'auto'
    is 'output-major'. Threads (BLAS's and the kernels'): `threads` fixes them, else the environment
    (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS...) does, else they are chosen from the steps' timings
    (`minigpt.generate.engines.tuning`). `quantize` 'int8': every block's linear layers as int8 rows with one
    scale each (`int8_linear`), output-major; the kernels hold them, and the head, as int8 bands
    (`quantized_bands`) and round each product's activations to int8 in blocks of 32 (as llama.cpp's
    q8_0), where the array path keeps the head and the activations float32; the embeddings stay float32.
    `kv_cache` 'float16': the cache holds keys and values rounded to float16 (half the bytes a step reads of
    it; the kernels widen them in registers), which a forward without a cache does not round.
    """

    name = "numpy"
    device = "cpu"
    dtype = "float32"

    def __init__(
        self,
        config: GPTConfig,
        tensors: Mapping[str, np.ndarray],
        *,
        layout: str = "output-major",
        threads: int | None = None,
        kernels: bool | None = None,
        quantize: str = "none",
        notice: Callable[[str], None] | None = None,
        tile_from: int | None | str = "auto",
        kv_cache: str = "float32",
        plan: Plan | None = None,
        prefetch: str = "auto",
    ) -> None:
        """`tensors` by GPT-2 name, as a run's weights file holds them (names and shapes checked before);
        `kernels`: compiled one-token steps (None: where numba is installed); `plan`: asked, where the
        kernels would run and `kernels` is None, whether to load them now
        (`minigpt.generate.engines.compiling`): (True, None) yes, (False, None) no, (False, ready) not
        yet: the engine decodes on its array path, holding the weights as the kernels do, and takes them
        up at the first new cache after `ready()` says numba's cache holds them; `notice` is told when
        they are about to be compiled here rather than read from numba's cache, and when the engine takes
        them up; `tile_from`: the kernels' batched steps by tiles for weight rows that long or longer
        (None: never; 'auto': `_pick_tiles`); `kv_cache`: what the KV cache holds keys and values in,
        float32 or float16 (`as_cached`); `prefetch`: how far ahead float32 bands ask for their weights,
        for every batch (`prefetch_setting`), or 'auto': as PREFETCH_ENV says, else `_pick_prefetch`."""
        if prefetch == "auto":
            prefetch = os.environ.get(PREFETCH_ENV, "").strip() or "auto"
        # none until measured: no distance carried over from another machine
        ahead = _kernels.PREFETCHES["none"] if prefetch == "auto" else prefetch_setting(prefetch)
        self._prefetch_given = prefetch != "auto"
        self.prefetch = dict.fromkeys(FETCH_ROWS, ahead)
        if isinstance(tile_from, str) and tile_from != "auto":
            raise UsageError(f"unknown tile_from {tile_from!r}: a row length, None or 'auto'")
        if kv_cache not in KV_CACHES[1:]:
            raise UsageError(f"unknown KV cache type {kv_cache!r}: choose one of {', '.join(KV_CACHES[1:])}")
        fused, layout, use_kernels = _decoding_tree(config, tensors, layout, kernels, quantize)
        self._ready: Callable[[], bool] | None = None
        if use_kernels and kernels is None and plan is not None:
            use_kernels, self._ready = plan(quantize, kv_cache)
        self.quantize = quantize
        self.kv_cache = kv_cache
        self.config = config
        self.block_size = config.block_size
        self.rotary = config.pos == "rope"
        self._threads, self._tile_from, self._notice = threads, tile_from, notice
        self.tuner = blas_tuner(
            threads, (_kernels.get_threads, _kernels.set_threads) if use_kernels else None
        )
        self.kernels = False  # while the layouts are timed: the array path's steps
        self.kernel_rows = 0  # a prefill's products of up to this many rows run through the kernels
        self._angles = None if config.pos != "rope" else RotaryTable(config.rope_base, config.head_dim)
        self._hold_weights(fused, layout, use_kernels)
        if self.kernels:
            self._load_kernels()

    def _hold_weights(self, fused: ModelWeights[np.ndarray], layout: str, use_kernels: bool) -> None:
        """Settle the layout (`pick_layout`) and hold the weights as the path that decodes reads them
        (`_hold`)."""
        have = available_bytes()  # timing both layouts needs room for a second copy of every matrix
        self.layout, self.weights = pick_layout(
            layout,
            {"output-major": lambda: fused, "input-major": lambda: _transposed(fused)},
            self._step_times,
            {"engine": "numpy", "numpy": np.__version__, "model": model_key(self.config)},
            have is None or inference_bytes(self.config) <= have,
        )
        self._hold(use_kernels and self.layout == "output-major")

    @property
    def path(self) -> str:
        """Which of the engine's paths decodes: its compiled kernels or its array operations."""
        return "kernels" if self.kernels else "array path"

    def _hold(self, kernels: bool) -> None:
        """Whether the kernels run, whether the blocks are held as bands (with the kernels, where they can
        be; int8 always, as `quantized_bands`, the head too), and the weights and head packed into the
        buffers a step reads (`packed`)."""
        self.kernels = kernels
        int8 = kernels and self.quantize == "int8"
        # the blocks' weights as `banded`, or as `quantized_bands`, which any widths can be (padded)
        self.bands = int8 or (kernels and can_band(self.weights))
        if self.bands:
            bands = quantized_bands if int8 else banded
            self.weights = dataclasses.replace(self.weights, h=map_linears(self.weights.h, bands))
        lm_head = _head(self.weights, self.layout == "input-major")
        # the head is a third of a GPT-2-sized model's bytes: int8 too (its float32 table still embeds)
        self.weights, self._head = packed(
            self.weights, quantized_bands(int8_linear(lm_head)) if int8 else lm_head
        )
        self._built: dict[tuple[int | None, tuple[int, int]], _kernels.ModelArgs] = {}  # `_args`
        self._use_tiles(None)

    def _load_kernels(self) -> None:
        """Load the kernels (compiling them where numba's cache lacks them) with one step now, so that the
        first step the user waits for does not, and measure their tiling and prefills."""
        if self._notice is not None and _kernels.missing(_kernels.entries(self.quantize, self.kv_cache)):
            self._notice(
                "compiling the NumPy engine's decoding kernels for this CPU, once (numba keeps them)"
            )
        idx = np.zeros((1, 1), dtype=np.int64)
        logits = self._forward(self.weights, self._head, idx, self.new_cache(1), False)
        # the draw's kernel too, so that reading it from numba's cache is no part of the first token's time
        sample_next(logits, 1.0, None, None, np.random.default_rng(0), compiled=True)
        if not self._prefetch_given:
            self._use_prefetch(self._pick_prefetch())
        tile_from = self._tile_from
        self._use_tiles(self._pick_tiles() if isinstance(tile_from, str) else tile_from)
        # bands have no NumPy product to lose to: every prefill's products are the kernels'
        self.kernel_rows = sys.maxsize if self.bands else self._pick_kernel_rows(self.quantize)

    def _take_up_kernels(self) -> None:
        """The kernels compiled elsewhere are in numba's cache: decode with them from now on (caches made
        before hold the same buffers, so generations under way go on through them)."""
        self._ready = None
        self.tuner = blas_tuner(self._threads, (_kernels.get_threads, _kernels.set_threads))
        self._hold(True)
        self._load_kernels()
        if self._notice is not None:
            self._notice("the CPU kernels are compiled: decoding with them from now on")

    @property
    def threads(self) -> int:
        return self.tuner.last

    def _use_tiles(self, tiles: dict[int, int | None] | int | None) -> None:
        """Steps of four rows or more through the kernels' tiles for weight rows `tile_from` long or
        longer (None: never; `kernels.tiled`): one row length for every batch, or one for each of
        TILE_ROWS (`tiles`: the batch it was measured at -> its row length)."""
        self.tiles = tiles if isinstance(tiles, dict) else dict.fromkeys(TILE_ROWS, tiles)
        self.tile_from = self.tiles[TILE_ROWS[0]]
        self._build_args()

    def _use_prefetch(self, ahead: dict[int, tuple[int, int]] | tuple[int, int]) -> None:
        """Float32 bands asking for their weights `ahead` bytes ahead (`kernels.PREFETCHES`): one distance
        for every batch, or one for each of FETCH_ROWS (the batch it was measured at -> its distance)."""
        self.prefetch = ahead if isinstance(ahead, dict) else dict.fromkeys(FETCH_ROWS, ahead)
        self._build_args()

    def _build_args(self) -> None:
        """The model as the kernels take it (`kernels.model_args`) for each batch width that has choices
        of its own (TILE_ROWS, FETCH_ROWS), and for a prefill, whose tokens are rows enough for tiles at
        every width (`_product`) and take the widest batch's prefetch."""
        if not self.kernels:
            self._model_args, self._prefill_args = {}, None
            return
        self._model_args = {
            rows: self._args(_at(self.tiles, rows), _at(self.prefetch, rows))
            for rows in sorted({*TILE_ROWS, *FETCH_ROWS})
        }
        self._prefill_args = self._args(0, _at(self.prefetch, sys.maxsize))

    def _args(self, tile_from: int | None, ahead: tuple[int, int]) -> _kernels.ModelArgs:
        """`kernels.model_args` for the held weights, each pair of choices built once (a few milliseconds
        for a deep model): the measurements switch between the same few pairs dozens of times."""
        key = (tile_from, ahead)
        if key not in self._built:
            self._built[key] = _kernels.model_args(self.weights, self._head, tile_from, ahead)
        return self._built[key]

    def _pick_tiles(self) -> dict[int, int | None]:
        """For each batch of TILE_ROWS, the row length from which its steps run fastest by tiles, on this
        CPU for these shapes: never, or from each of the model's input widths, as `remembered` keeps it
        from steps of that many rows timed with each (the first loads on a machine measure, later ones
        read the answer): which widths gain depends on the CPU, the shapes and the batch. Only rows tile:
        where the blocks are bands the answer is the head's, and where the head is int8 bands too there is
        nothing to measure."""
        widths: set[int] = set()

        def width(lin: LinearWeights[np.ndarray]) -> LinearWeights[np.ndarray]:
            if lin.weight.ndim == 2:
                widths.add(lin.weight.shape[1])
            return lin

        map_linears((self.weights, self._head), width)
        if not widths:
            return dict.fromkeys(TILE_ROWS, None)
        choices = {"rows": None, **{f"tiles from {w}": w for w in sorted(widths)}}
        self.tuner.use(self.tuner.candidates[0])
        return self._fastest_steps("numpy tiles", TILE_ROWS, choices, self._use_tiles)

    def _pick_prefetch(self) -> dict[int, tuple[int, int]]:
        """For each batch of FETCH_ROWS, how far ahead its float32 bands ask for their weights: the
        fastest of `kernels.PREFETCHES` on steps of that many rows on every core, on this CPU for these
        shapes, as `remembered` keeps it. Asking early keeps the caches and memory busy while the sums
        run, but each request is an instruction and a line the caches may not want yet: at one row the
        sums may be too short to hide a fetch, and how far ahead pays depends on the caches' sizes and
        the memory's latency. Only float32 bands ask: elsewhere there is nothing to measure."""
        if not self.bands or self.quantize == "int8":
            return dict.fromkeys(FETCH_ROWS, _kernels.PREFETCHES["none"])
        self.tuner.use(self.tuner.candidates[-1])  # a quiet machine's steps take every core
        # the best of two rounds a load: three loads keep the best of six, and a step of a model past the
        # caches takes tens of milliseconds at eight rows, so that five rounds would cost seconds a load
        return self._fastest_steps("numpy prefetch", FETCH_ROWS, _kernels.PREFETCHES, self._use_prefetch, 2)

    def _fastest_steps(
        self,
        kind: str,
        widths: Sequence[int],
        choices: Mapping[str, T],
        use: Callable[[T], None],
        rounds: int = 5,
    ) -> dict[int, T]:
        """For each batch width of `widths`, the fastest of `choices` (each put in place by `use`) on
        one-token steps of that many rows (`best_times` over `rounds`), as `remembered` keeps it per
        machine, library versions, model shape, threads and width (the first loads on a machine time
        them, later ones read the answer)."""
        key = {
            "engine": kind, "numpy": np.__version__, "numba": _kernels.VERSION, "model": model_key(self.config),
            "quantize": self.quantize, "threads": self.tuner.last,
        }  # fmt: skip
        picked = {}
        for rows in widths:
            cache = self.new_cache(rows, capacity=8)  # a few positions: what is timed is the weights
            idx = np.zeros((rows, 1), dtype=np.int64)

            def step(cache: Cache = cache, idx: np.ndarray = idx) -> object:
                return self._forward(self.weights, self._head, idx, cache, False)

            def prepare(name: str, cache: Cache = cache) -> None:  # untimed: the choice's args built
                use(choices[name])
                cache.reset()

            chosen = remembered(
                {**key, "rows": rows},
                list(choices),
                lambda step=step, prepare=prepare: best_times(
                    dict.fromkeys(choices, step), rounds, prepare=prepare
                ),
            )
            picked[rows] = choices[chosen]
        return picked

    def _pick_kernel_rows(self, quantize: str) -> int:
        """Up to how many rows a prefill's products run fastest through the kernels (`kernels.matvec`)
        rather than NumPy's matrix product, on this CPU for these shapes: timed on the first block's
        largest matrix at PREFILL_PROBES rows, as `remembered` keeps it.

        BLAS runs a prefill on one thread (`blas_tuner`), and for a few rows it repacks the whole matrix
        before multiplying, so the kernels' products, bound by the memory as in a step, beat it on short
        prefills, and BLAS's blocked products win on long ones; where they cross depends on the CPU."""
        lins = [self.weights.h[0].attn.c_attn, self.weights.h[0].mlp.c_fc, self.weights.h[0].mlp.c_proj]
        lin = max(lins, key=lambda w: w.weight.size)
        rng = np.random.default_rng(0)
        xs = {
            rows: rng.standard_normal((rows, lin.weight.shape[1]), dtype=np.float32)
            for rows in PREFILL_PROBES
        }
        self.tuner.use(self.tuner.candidates[-1])  # a prefill on a quiet machine takes every core
        runs: dict[str, Callable[[], object]] = {}
        for rows, x in xs.items():
            runs[f"kernels {rows}"] = functools.partial(_kernels.matvec, lin, x, 0)
            runs[f"numpy {rows}"] = functools.partial(linear, lin, x)
        choices = {"never": 0, **{f"up to {rows} rows": rows for rows in PREFILL_PROBES}}

        def measure() -> dict[str, float]:
            t = best_times(runs, rounds=2)
            # each probe weighs the same: its time over the faster way's, summed over the probes
            cost = {r: {"k": t[f"kernels {r}"], "n": t[f"numpy {r}"]} for r in PREFILL_PROBES}
            return {
                name: sum(c["k" if r <= limit else "n"] / min(c.values()) for r, c in cost.items())
                for name, limit in choices.items()
            }

        key = {
            "engine": "numpy prefill", "numpy": np.__version__, "numba": _kernels.VERSION,
            "model": model_key(self.config), "quantize": quantize, "threads": self.tuner.candidates[-1],
        }  # fmt: skip
        return choices[remembered(key, list(choices), measure)]

    def _product(self, w: LinearWeights[np.ndarray], x: np.ndarray) -> np.ndarray:
        """x (..., in) through the linear layer w in a prefill: by the kernels up to `kernel_rows` rows (by
        tiles at every width: a prefill's rows are many, enough for a tile's reuse of each loaded value to
        pay at any width), else by NumPy's matrix product (`linear`)."""
        rows = x.size // x.shape[-1]
        if rows > self.kernel_rows:
            return linear(w, x)
        out = _kernels.matvec(w, x.reshape(rows, x.shape[-1]), 0, _at(self.prefetch, rows))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def new_cache(self, batch: int, capacity: int | None = None) -> Cache:
        """Empty keys and values for `batch` rows: each layer's window (`capacity`: at most that many
        positions, a ring). A generation starts here: where the kernels are compiled elsewhere and now
        ready, the engine takes them up first."""
        if self._ready is not None and self._ready():
            self._take_up_kernels()
        c = self.config
        shapes = [
            (batch, c.kv_heads, min(window, capacity or window), c.head_dim) for window in c.layer_windows
        ]
        # one buffer for every layer's keys and values: a batch's cache on 2 MB pages, not thousands of
        # 4 KB ones that a step's reads of it would miss the TLB on
        buffers = arena(shapes + shapes, self.kv_cache, zeros=True)
        keys, values = buffers[: len(shapes)], buffers[len(shapes) :]
        return KernelCache(keys, values, c.block_size if c.pos == "learned" else None)

    def forward(
        self, ids: Sequence[Sequence[int]], cache: Cache | None, *, every_position: bool = False
    ) -> np.ndarray:
        idx = np.asarray(ids, dtype=np.int64)
        rows, new = idx.shape
        with self.tuner.step((rows, new == 1), work=new):
            return self._forward(self.weights, self._head, idx, cache, every_position)

    def _forward(
        self,
        weights: ModelWeights[np.ndarray],
        lm_head: LinearWeights[np.ndarray],
        idx: np.ndarray,
        cache: Cache | None,
        every_position: bool,
    ) -> np.ndarray:
        """The logits of the tokens idx through `weights` and `lm_head` (a one-token step over the cache
        through the kernels: the engine's own weights, as `_model_args` holds them)."""
        if self.kernels and isinstance(cache, KernelCache) and idx.shape == (cache.batch, 1):
            logits = self._step(idx[:, 0], cache)
            return logits[:, None] if every_position else logits
        if isinstance(cache, KernelCache) and self._compiled_prefill(idx, cache):
            return self._prefill(idx, cache, every_position)
        # exp overflows to inf where GELU and SiLU round to their limits (x/inf = 0): as intended
        with np.errstate(over="ignore"):
            x = transformer(
                weights, idx, cache, self._angles, functools.partial(block, product=self._product)
            )
        logits = head(weights, lm_head, x if every_position else x[:, -1], self._product)
        if cache is None or logits.shape[0] == cache.batch:
            return logits
        return np.broadcast_to(logits, (cache.batch, *logits.shape[1:]))

    def _step(self, tokens: np.ndarray, cache: KernelCache) -> np.ndarray:
        """Logits (B, V) of one new token of each row of the cache, as one compiled call
        (`kernels.model_step`)."""
        start = first_position(cache, 1, self.config.block_size if self.config.pos == "learned" else None)
        mixed = isinstance(start, np.ndarray)  # rows at different positions
        positions = cache.positions  # each row's next position: read by the call, advanced after it
        rope = None
        if self._angles is not None:
            rope = self._angles.at(positions) if mixed else self._angles(start, 1)
        args = _at(self._model_args, len(tokens))  # the tiling and prefetch measured for its width
        logits = _kernels.model_step(args, tokens, cache.kernel, positions, rope)
        cache.advance(1)
        return logits

    def _compiled_prefill(self, idx: np.ndarray, cache: KernelCache) -> bool:
        """Whether the tokens idx (rows, T) go through the kernels as one call (`_prefill`): a cache whose
        rows share a position, every layer's buffer holding the whole sequence (no ring wraps within
        it), and up to PREFILL_PROBES[0] tokens in all or `kernel_rows` (past them BLAS's blocked
        products win; below the smallest probe one call beats the array path's few hundred)."""
        most = max(self.kernel_rows, PREFILL_PROBES[0])
        if not self.kernels or cache.mixed or not 0 < idx.size <= most:
            return False
        rows, new = idx.shape
        fits = cache.pos + new <= min(cache.capacity)
        return fits and (rows == cache.batch or (rows == 1 and cache.pos == 0))

    def _prefill(self, idx: np.ndarray, cache: KernelCache, every_position: bool) -> np.ndarray:
        """The logits of tokens idx (rows, T) after the cached ones, as one compiled call
        (`kernels.model_step`, every token its own query row, each attending to its row's slots up to its
        position), where the array path would spend a short prompt's prefill on a few hundred NumPy
        calls, each costing more than the arithmetic it does. One row of an empty cache serves every row
        (samples of one prompt): its keys and values are copied into the others."""
        rows, new = idx.shape
        wpe = self.weights.wpe
        start = first_position(cache, new, None if wpe is None else wpe.shape[0])
        assert isinstance(start, int)  # a cache whose rows share a position (`_compiled_prefill`)
        positions = np.tile(np.arange(start, start + new, dtype=np.int64), rows)
        rope = None
        if self._angles is not None:
            rope = tuple(np.tile(a, (rows, 1)) for a in self._angles(start, new))
        logits = _kernels.model_step(
            self._prefill_args, np.ascontiguousarray(idx).reshape(-1), cache.kernel, positions, rope,
            np.repeat(np.arange(rows, dtype=np.int64), new),
            None if every_position else np.arange(new - 1, rows * new, new, dtype=np.int64),
        )  # fmt: skip
        for k, v in zip(cache.k, cache.v, strict=True):
            k[rows:, :, start : start + new] = k[:1, :, start : start + new]
            v[rows:, :, start : start + new] = v[:1, :, start : start + new]
        cache.advance(new)
        if every_position:
            logits = logits.reshape(rows, new, -1)
        return np.broadcast_to(logits, (cache.batch, *logits.shape[1:])) if rows < cache.batch else logits

    def _step_times(self, trees: dict[str, ModelWeights[np.ndarray]]) -> dict[str, float]:
        """Each layout's best time for a one-token step, on the thread count a step starts with."""
        heads = {name: _head(tree, name == "input-major") for name, tree in trees.items()}
        cache, idx = self.new_cache(1), np.zeros((1, 1), dtype=np.int64)
        self.tuner.use(self.tuner.candidates[0])

        def step(name: str) -> Callable[[], object]:
            return lambda: (cache.reset(), self._forward(trees[name], heads[name], idx, cache, False))

        return best_times({name: step(name) for name in trees})

    def gather(self, parts: Sequence[tuple[Cache, int, int]]) -> Cache:
        return gather_rows(self.new_cache, parts)

    def log_probs(self, logits: np.ndarray) -> np.ndarray:
        return log_softmax(logits)

    def sample(
        self,
        logits: np.ndarray,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        rng: np.random.Generator,
    ) -> list[int]:
        return sample_next(logits, temperature, top_k, top_p, rng, compiled=self.kernels).tolist()

    def rng(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis of float logits of any shape."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _head(weights: ModelWeights[np.ndarray], input_major: bool) -> LinearWeights[np.ndarray]:
    """The LM head as a linear layer in the engine's layout (a tied head gets its own transposed copy)."""
    if input_major:
        return LinearWeights(transposed(weights.lm_head), None, input_major=True)
    return LinearWeights(weights.lm_head, None)
