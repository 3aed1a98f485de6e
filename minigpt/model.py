"""The GPT-2 style decoder-only transformer: embeddings, pre-norm blocks, LM head (no I/O here)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.config import GPTConfig
from minigpt.errors import UsageError

__all__ = ["GPT", "GPTConfig", "KVCacheLike"]


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # random init of a large model costs seconds, and the meta device pulls in torch._dynamo for
    # nn.Embedding; loading only needs the storage, so the init methods become no-ops for a moment
    classes = (nn.Linear, nn.Embedding, nn.LayerNorm)
    saved = [c.reset_parameters for c in classes]
    saved_gpt = GPT.reset_parameters
    try:
        for c in classes:
            c.reset_parameters = lambda self: None  # type: ignore[method-assign]
        GPT.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for c, fn in zip(classes, saved, strict=True):
            c.reset_parameters = fn  # type: ignore[method-assign]
        GPT.reset_parameters = saved_gpt  # type: ignore[method-assign]


class KVCacheLike(Protocol):
    """What attention needs from a key/value cache (the sampling engine owns the real one)."""

    pos: int

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H, T, hd) at positions pos..pos+T and return all keys/values so far."""
        ...

    def advance(self, n: int) -> None:
        """Move pos forward by n once every layer has stored its keys and values."""
        ...


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project x (B, T, C) to per-head queries, keys and values, each (B, H, T, hd)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        return (q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def forward(self, x: torch.Tensor, kv_cache: KVCacheLike | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x)
        past = 0
        if kv_cache is not None:
            past = kv_cache.pos
            k, v = kv_cache.update(self.layer, k, v)
        dropout_p = self.dropout if self.training else 0.0
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=T > 1)
        elif T == 1:
            # one new query may look at every cached key: no mask needed
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            # SDPA's is_causal aligns the mask top-left, wrong when queries start at `past`
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.d_ff, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new, so imported weights match exactly
        self.c_proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: KVCacheLike | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, n_layer pre-norm blocks, final LayerNorm, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.reset_parameters()

    @classmethod
    def uninitialized(cls, config: GPTConfig) -> GPT:
        """A GPT with allocated but uninitialised weights, fast to build when loaded weights replace them."""
        with _skip_init():
            return cls(config)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm gains
                nn.init.ones_(p)

    def num_params(self) -> int:
        """Parameters the module holds, a tied tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCacheLike | None = None,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits, loss).

        With targets (B, T): logits (B, T, V) and the mean cross-entropy (targets of -1 are ignored).
        Without: logits of the last position only, (B, V), unless all_logits asks for (B, T, V).
        With a kv_cache, idx holds only the new tokens, placed after kv_cache.pos cached ones.
        """
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise UsageError(
                f"sequence of {start + T} tokens is longer than the model's block_size "
                f"{self.config.block_size}"
            )
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
            return logits, loss
        if all_logits:
            return self.lm_head(x), None
        return self.lm_head(x[:, -1, :]), None
