"""The torch generation engine: a preallocated KV cache, top-k/top-p sampling, the decode loop.

The context-window policy, streamed text and the `Generation` driver are backend-free and live in
`minigpt.generation` (re-exported here); `minigpt.numpy_engine` is the torch-free CPU engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from minigpt.errors import UsageError
from minigpt.generation import (
    Generation,
    SampleResult,
    TextEvent,
    TextStream,
    check_sampling,
    default_slide,
    encode_prompt,
    generate,
    resolve_slide,
    window_drop,
)
from minigpt.model import GPT

__all__ = [
    "DecodeStep",
    "Generation",
    "KVCache",
    "SampleResult",
    "TextEvent",
    "TextStream",
    "TorchEngine",
    "check_sampling",
    "decode_tokens",
    "default_slide",
    "encode_prompt",
    "generate",
    "generate_uncached",
    "make_generator",
    "resolve_slide",
    "sample_next",
    "window_drop",
]


class KVCache:
    """Keys and values of every layer in preallocated (n_layer, B, H, block_size, hd) buffers.

    Implements the protocol GPT.forward expects: `update` writes in place (no concatenation per step) and
    returns views of everything cached so far; `advance` moves `pos` once all layers have written.
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layer, batch, n_head, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, so a step indexes one small tensor rather than the 5-d buffer
        self._k = [self.k[i] for i in range(n_layer)]
        self._v = [self.v[i] for i in range(n_layer)]
        self.block_size = block_size
        self.pos = 0

    @classmethod
    def for_model(cls, model: GPT, batch: int) -> KVCache:
        """A cache shaped for `model`, in its dtype and on its device."""
        c = model.config
        w = model.transformer.wte.weight
        return cls(c.n_layer, batch, c.n_head, c.block_size, c.head_dim, w.dtype, w.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, H, T, hd) at pos..pos+T; a 1-row update of an empty cache fills every row.

        That is how B samples share one prefill of their common prompt: the prompt runs as one row, its
        keys and values are broadcast into all B rows, and the following steps run all B rows.
        """
        rows, end = k.size(0), self.pos + k.size(2)
        if end > self.block_size:
            raise UsageError(f"KV cache overflow: {end} positions, room for {self.block_size}")
        if rows != self.k.size(1) and not (rows == 1 and self.pos == 0):
            raise UsageError(f"KV cache holds {self.k.size(1)} rows, got {rows}")
        kl, vl = self._k[layer], self._v[layer]
        kl[:, :, self.pos : end] = k
        vl[:, :, self.pos : end] = v
        return kl[:rows, :, :end], vl[:rows, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused, not freed)."""
        self.pos = 0


# --- sampling -------------------------------------------------------------------------------------------


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next-token ids (B,) from last-position logits (B, V).

    Temperature 0 is greedy (the generator is not touched). Otherwise the logits are divided by the
    temperature, cut to the top_k most likely tokens, then to the smallest set whose probability reaches
    top_p (top-k and top-p compose in that order), and one token is drawn per row with `generator`.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    vocab = logits.size(-1)
    if top_k is not None and top_k < vocab:
        # scatter exactly k values: a `logits < kth` mask would keep every token tied with the k-th
        values, indices = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, indices, values)
    if top_p is not None and top_p < 1:
        sorted_logits, indices = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, indices, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --- token loops ----------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_uncached(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Reference loop: a full forward pass over the current window for every token; returns (B, N) ids.

    idx (B, T) holds B prompts, or one prompt (1, T) continued as num_samples rows.
    """
    block_size = model.config.block_size
    slide = resolve_slide(slide, block_size)
    seq = idx[:, -block_size:].expand(num_samples, -1) if num_samples > 1 else idx[:, -block_size:]
    start = 0
    new = []
    for _ in range(max_new_tokens):
        logits, _ = model(seq[:, start:])
        token = sample_next(logits, temperature, top_k, top_p, generator)
        new.append(token)
        seq = torch.cat([seq, token[:, None]], dim=1)
        start += window_drop(seq.size(1) - start, block_size, slide)
    return torch.stack(new, dim=1) if new else idx.new_empty(idx.size(0), 0)


class DecodeStep:
    """GPT.forward for one new token per row, written as a flat sequence of tensor ops.

    Prefills go through GPT.forward. A single-token step through the modules spends a fifth (1 CPU
    thread) to a third (2 threads) of its time on module calls, head reshapes and small copies; this
    reads the same parameters and skips all of that, giving bit-identical logits here. `supports` says
    when it applies (a GPT exactly as model.py defines it, in eval mode); tests hold it to GPT.forward.
    """

    def __init__(self, model: GPT) -> None:
        c = model.config
        t = model.transformer
        self.n_head, self.n_embd, self.head_dim = c.n_head, c.n_embd, c.head_dim
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.layers = [
            (
                b.ln_1.weight, b.ln_1.bias, b.ln_1.eps, b.attn.c_attn.weight, b.attn.c_attn.bias,
                b.attn.c_proj.weight, b.attn.c_proj.bias, b.ln_2.weight, b.ln_2.bias, b.ln_2.eps,
                b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.gelu.approximate, b.mlp.c_proj.weight,
                b.mlp.c_proj.bias,
            )
            for b in t.h
        ]  # fmt: skip
        self.ln_f = (t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
        self.head = model.lm_head.weight

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return type(model) is GPT and not model.training

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) after feeding token (B,) at position cache.pos; advances the cache."""
        pos, (B,), C = cache.pos, token.shape, self.n_embd
        if pos >= cache.block_size:
            raise UsageError(f"KV cache overflow: {pos + 1} positions, room for {cache.block_size}")
        x = F.embedding(token, self.wte) + self.wpe[pos]
        for i, layer in enumerate(self.layers):
            w1, b1, e1, wa, ba, wo, bo, w2, b2, e2, wf, bf, approximate, wp, bp = layer
            qkv = F.linear(F.layer_norm(x, (C,), w1, b1, e1), wa, ba)
            qkv = qkv.view(B, 3, self.n_head, 1, self.head_dim)
            k_all, v_all = cache.k[i, :, :, : pos + 1], cache.v[i, :, :, : pos + 1]
            k_all[:, :, pos:].copy_(qkv[:, 1])
            v_all[:, :, pos:].copy_(qkv[:, 2])
            y = F.scaled_dot_product_attention(qkv[:, 0], k_all, v_all)  # one query sees every key
            x = x + F.linear(y.view(B, C), wo, bo)
            h = F.gelu(F.linear(F.layer_norm(x, (C,), w2, b2, e2), wf, bf), approximate=approximate)
            x = x + F.linear(h, wp, bp)
        cache.advance(1)
        return F.linear(F.layer_norm(x, (C,), *self.ln_f), self.head)


@torch.inference_mode()
def decode_tokens(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next-token ids (B,) step by step: the prompts idx (B, T) are prefilled in one forward
    pass, then each step feeds one token per row through the KV cache. Same tokens as `generate_uncached`.

    With num_samples > 1, idx is one prompt (1, T): it is prefilled once as a single row and continued as
    num_samples rows. The next token is fed only when the caller asks for it, so stopping early wastes
    no forward pass.
    """
    block_size = model.config.block_size
    slide = resolve_slide(slide, block_size)
    if num_samples > 1 and idx.size(0) != 1:
        raise UsageError(f"num_samples={num_samples} needs one prompt, got {idx.size(0)}")
    batch = max(idx.size(0), num_samples)
    cache = KVCache.for_model(model, batch)
    window = torch.empty(batch, block_size, dtype=torch.long, device=idx.device)  # the cached tokens
    prompt = idx[:, -block_size:]
    window[:, : prompt.size(1)] = prompt
    if DecodeStep.supports(model):
        step_one = DecodeStep(model)
    else:

        def step_one(token: torch.Tensor, cache: KVCache) -> torch.Tensor:
            return model(token[:, None], kv_cache=cache)[0]

    logits, _ = model(prompt, kv_cache=cache)
    logits = logits.expand(batch, -1)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        if step + 1 == max_new_tokens:
            return
        pos = cache.pos
        drop = window_drop(pos + 1, block_size, slide)
        if drop:
            keep = pos - drop
            window[:, :keep] = window[:, drop:pos].clone()
            window[:, keep] = token
            cache.reset()
            logits, _ = model(window[:, : keep + 1], kv_cache=cache)
        else:
            window[:, pos] = token
            logits = step_one(token, cache)


class TorchEngine:
    """`decode_tokens` behind the backend-free Engine protocol: any device and dtype the model is on."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.block_size = model.config.block_size

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
        device = self.model.transformer.wte.weight.device
        idx = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        steps = decode_tokens(
            self.model, idx, max_new_tokens, num_samples=num_samples, slide=slide, temperature=temperature,
            top_k=top_k, top_p=top_p, generator=make_generator(seed, device),
        )  # fmt: skip
        try:
            for tokens in steps:
                yield tokens.tolist()
        finally:
            steps.close()
