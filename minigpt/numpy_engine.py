"""Generation in NumPy on the CPU: model.py's GPT, a KV cache and sampling, without importing torch.

`import torch` alone takes 2-3 s on a small CPU machine, longer than generating a few hundred tokens from
a small model, so `minigpt generate` runs float32 CPU generation here and starts in a fraction of a second.
Same model, same window policy (minigpt.generation), same sampling rules as the torch engine; tests hold
its logits to GPT.forward and its greedy tokens to the torch engine's. Random draws come from NumPy's
PCG64, so a seed reproduces text on this engine (the torch engine's generator gives other text).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.generation import NUMPY_DTYPES, resolve_slide, window_drop
from minigpt.rundir import RunDir
from minigpt.tokenizer import Tokenizer
from minigpt.weights import check_shapes

__all__ = ["NumpyEngine", "NumpyGPT", "NumpyKVCache", "sample_next"]

_GELU_C = math.sqrt(2.0 / math.pi)


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    centred = x - x.mean(-1, keepdims=True)
    y = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + np.float32(eps)) * weight
    return y if bias is None else y + bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    # GPT-2's gelu_new, the same formula as torch's GELU(approximate="tanh")
    return 0.5 * x * (1.0 + np.tanh(np.float32(_GELU_C) * (x + np.float32(0.044715) * x * x * x)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class NumpyKVCache:
    """Keys and values of every layer in preallocated (n_layer, B, H, block_size, hd) float32 buffers."""

    def __init__(self, config: GPTConfig, batch: int) -> None:
        shape = (config.n_layer, batch, config.n_head, config.block_size, config.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.block_size = config.block_size
        self.pos = 0


class NumpyGPT:
    """The forward pass of model.py's GPT (eval mode) in float32 NumPy, fed through a KV cache."""

    def __init__(
        self, config: GPTConfig, weights: dict[str, np.ndarray], source: Path = Path("weights")
    ) -> None:
        check_shapes(config, {k: tuple(v.shape) for k, v in weights.items()}, source)
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        self.config = config
        self.wte, self.wpe = w["transformer.wte.weight"], w["transformer.wpe.weight"]
        # the head as (V, C), multiplied as head @ x.T: a contiguous gemv, and no copy of a tied wte
        self.head = w.get("lm_head.weight", self.wte)

        def bias(name: str) -> np.ndarray | None:
            return w.get(f"{name}.bias")

        def t(name: str) -> np.ndarray:
            # x @ W.T against a transposed view is ten times slower in NumPy than against a copy
            return np.ascontiguousarray(w[name].T)

        self.layers = []
        for i in range(config.n_layer):
            p = f"transformer.h.{i}"
            self.layers.append(
                (
                    w[f"{p}.ln_1.weight"], bias(f"{p}.ln_1"),
                    t(f"{p}.attn.c_attn.weight"), bias(f"{p}.attn.c_attn"),
                    t(f"{p}.attn.c_proj.weight"), bias(f"{p}.attn.c_proj"),
                    w[f"{p}.ln_2.weight"], bias(f"{p}.ln_2"),
                    t(f"{p}.mlp.c_fc.weight"), bias(f"{p}.mlp.c_fc"),
                    t(f"{p}.mlp.c_proj.weight"), bias(f"{p}.mlp.c_proj"),
                )
            )  # fmt: skip
        self.ln_f = (w["transformer.ln_f.weight"], bias("transformer.ln_f"))

    def forward(self, ids: np.ndarray, cache: NumpyKVCache) -> np.ndarray:
        """Logits (B, V) of the last position after feeding ids (B, T) at cache.pos..cache.pos+T.

        A 1-row feed into an empty cache of B rows fills every row: B samples share one prefill.
        """
        c = self.config
        (B, T), pos = ids.shape, cache.pos
        end = pos + T
        if end > cache.block_size:
            raise UsageError(f"sequence of {end} tokens is longer than the model's block_size {c.block_size}")
        if B != cache.k.shape[1] and not (B == 1 and pos == 0):
            raise UsageError(f"KV cache holds {cache.k.shape[1]} rows, got {B}")
        H, hd, eps = c.n_head, c.head_dim, c.layer_norm_eps
        scale = np.float32(1.0 / math.sqrt(hd))
        # a query at position pos+t sees keys 0..pos+t
        hidden = np.triu(np.ones((T, end), dtype=bool), k=pos + 1) if T > 1 else None
        x = self.wte[ids] + self.wpe[pos:end]
        for i, (g1, b1, wa, ba, wo, bo, g2, b2, wf, bf, wp, bp) in enumerate(self.layers):
            qkv = _layer_norm(x, g1, b1, eps) @ wa
            if ba is not None:
                qkv += ba
            q, k, v = qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            cache.k[i, :, :, pos:end] = k
            cache.v[i, :, :, pos:end] = v
            att = (q @ cache.k[i, :B, :, :end].swapaxes(-1, -2)) * scale
            if hidden is not None:
                att[..., hidden] = -np.inf
            y = (_softmax(att) @ cache.v[i, :B, :, :end]).transpose(0, 2, 1, 3).reshape(B, T, c.n_embd)
            x = x + y @ wo
            if bo is not None:
                x += bo
            h = _layer_norm(x, g2, b2, eps) @ wf
            if bf is not None:
                h += bf
            x = x + _gelu_tanh(h) @ wp
            if bp is not None:
                x += bp
        cache.pos = end
        return (self.head @ _layer_norm(x[:, -1], *self.ln_f, eps).T).T


def sample_next(
    logits: np.ndarray,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Next-token ids (B,) from logits (B, V), by the torch engine's rules: temperature 0 is argmax (rng
    untouched); otherwise divide by the temperature, keep exactly the top_k largest, then the smallest set
    reaching top_p, and draw one token per row."""
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
        p = _softmax(ranked)
        ranked[np.cumsum(p, -1) - p >= top_p] = -np.inf  # the tokens ranked above already reach top_p
        np.put_along_axis(z, order, ranked, -1)
    cdf = np.cumsum(_softmax(z), -1)
    u = rng.random(rows) * cdf[:, -1]
    # side="right" never lands on a zero-probability token: its cdf step is empty
    picks = [np.searchsorted(cdf[r], u[r], side="right") for r in range(rows)]
    return np.minimum(np.array(picks, dtype=np.int64), vocab - 1)


class NumpyEngine:
    """The KV-cache decode loop of minigpt.sampling.decode_tokens over a NumpyGPT (the Engine protocol)."""

    def __init__(self, model: NumpyGPT) -> None:
        self.model = model
        self.block_size = model.config.block_size

    @classmethod
    def load(cls, run_dir: Path) -> tuple[NumpyEngine, Tokenizer, dict[str, Any]]:
        """The engine, tokenizer and config.json of a run directory, with the checks of `load_run`."""
        run = RunDir(run_dir)
        data, config, tokenizer = run.open()
        unreadable = sorted(run.weight_dtypes() - set(NUMPY_DTYPES))
        if unreadable:
            raise MinigptError(
                f"{run.weights_path} holds {unreadable[0]} tensors, which NumPy cannot read: use --backend torch"
            )
        weights = run.load_weights(config, framework="np")
        return cls(NumpyGPT(config, weights, run.weights_path)), tokenizer, data

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        num_samples: int = 1,
        slide: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ) -> Iterator[list[int]]:
        block = self.block_size
        slide = resolve_slide(slide, block)
        rng = np.random.default_rng(seed)
        cache = NumpyKVCache(self.model.config, num_samples)
        window = np.empty((num_samples, block), dtype=np.int64)  # the cached tokens
        prompt = np.asarray(list(prompt_ids)[-block:], dtype=np.int64)[None]
        window[:, : prompt.shape[1]] = prompt
        logits = self.model.forward(prompt, cache)
        logits = np.broadcast_to(logits, (num_samples, logits.shape[-1]))
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, rng)
            yield token.tolist()
            if step + 1 == max_new_tokens:
                return
            pos = cache.pos
            drop = window_drop(pos + 1, block, slide)
            if drop:
                keep = pos - drop
                window[:, :keep] = window[:, drop:pos].copy()
                window[:, keep] = token
                cache.pos = 0
                logits = self.model.forward(window[:, : keep + 1], cache)
            else:
                window[:, pos] = token
                logits = self.model.forward(token[:, None], cache)
