"""The GPT-2 style decoder-only transformer: embeddings, pre-norm blocks, LM head (no I/O here).

The modules hold the parameters under GPT-2's names; the computation is written once, as functions over
the `ModelWeights` tree that `GPT.weights()` reads from them. `GPT.forward` runs it for training, prefill,
single-token decoding through a KV cache and attention maps alike; a caller that steps many times
(a decoder) reads the tree once and passes it in, sparing every step the nn.Module attribute lookups.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

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

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "attend",
    "block",
    "causal_mask",
    "linear",
    "mlp",
    "norm",
    "qkv",
    "transformer",
]

Cache = KVCache[torch.Tensor]


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


def _norm(config: GPTConfig) -> nn.Module:
    """The normalisation every block and the final layer use (GPT-2: LayerNorm)."""
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    """Parameters of multi-head causal self-attention (computed by `attend`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)


class MLP(nn.Module):
    """Parameters of the feed-forward layer (computed by `mlp`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.d_ff, bias=config.bias)
        self.c_proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)


class Block(nn.Module):
    """Parameters of a pre-norm transformer block (computed by `block`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = MLP(config)


class GPT(nn.Module):
    """Token + position embeddings, n_layer pre-norm blocks, final LayerNorm, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=_norm(config),
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

    def weights(self) -> ModelWeights[torch.Tensor]:
        """The parameters as the named tree the forward pass reads (the tensors themselves, not copies).

        It holds the parameter objects of this moment: in-place updates (training steps) show through,
        parameters replaced afterwards (load_state_dict(assign=True)) do not: read it again then.
        """
        return weights_by_name(self.config, dict(self.named_parameters()))

    def new_cache(self, batch: int) -> Cache:
        """An empty KV cache of `batch` rows for every position, in the model's dtype and on its device."""
        c = self.config
        w = self.transformer.wte.weight
        shape = (c.n_layer, batch, c.n_head, c.block_size, c.head_dim)
        return KVCache(w.new_zeros(shape), w.new_zeros(shape))

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: Cache | None = None,
        all_logits: bool = False,
        attention: list[torch.Tensor] | None = None,
        weights: ModelWeights[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits, loss): training, prefill and single-token decoding all run through here.

        With targets (B, T): logits (B, T, V) and the mean cross-entropy (targets of -1 are ignored).
        Without: logits of the last position only, (B, V), unless all_logits asks for (B, T, V).
        With a kv_cache, idx holds only the new tokens, placed after kv_cache.pos cached ones.
        With an `attention` list, every layer appends its attention probabilities (B, H, T, pos + T).
        `weights`: this model's `weights()`, read once by a caller that steps many times.
        """
        w = self.weights() if weights is None else weights
        dropout = self.config.dropout if self.training else 0.0
        x = transformer(w, idx, kv_cache, attention, dropout)
        if targets is not None:
            logits = F.linear(x, w.lm_head)
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
            return logits, loss
        return F.linear(x if all_logits else x[:, -1, :], w.lm_head), None


# --- the computation, written once --------------------------------------------------------------------


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(x, p) if p else x  # inference passes p=0: not even a call


def norm(w: NormWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.size(-1),), w.weight, w.bias, w.eps)


def linear(w: LinearWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.weight, w.bias)


def causal_mask(queries: int, past: int, device: torch.device) -> torch.Tensor:
    """(queries, past + queries) booleans, True where the query at position past+i may see the key."""
    return torch.ones(queries, past + queries, dtype=torch.bool, device=device).tril(diagonal=past)


def qkv(
    w: AttentionWeights[torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project x (B, T, C) to per-head queries, keys and values, each a (B, H, T, hd) view."""
    B, T, C = x.shape
    q, k, v = linear(w.c_attn, x).view(B, T, 3, w.n_head, C // w.n_head).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def attend(
    w: AttentionWeights[torch.Tensor],
    x: torch.Tensor,
    layer: int,
    cache: Cache | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal self-attention of x (B, T, C) over itself and, with a cache, every position cached before.

    Fused SDPA by default; with an `attention` list it computes softmax(QKᵀ/√d) explicitly and appends
    the probabilities (B, H, T, past + T), so inspection reads the very attention the model runs.
    """
    B, T, C = x.shape
    q, k, v = qkv(w, x)
    past = 0
    if cache is not None:
        past = cache.pos
        k, v = cache.update(layer, k, v)
    if attention is None:
        y = _fused_attention(q, k, v, past, dropout)
    else:
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.size(-1))
        probs = scores.masked_fill(~causal_mask(T, past, x.device), float("-inf")).softmax(dim=-1)
        attention.append(probs)
        y = _dropout(probs, dropout).to(v.dtype) @ v
    # reshape is a view, not a copy, for a single new token
    return _dropout(linear(w.c_proj, y.transpose(1, 2).reshape(B, T, C)), dropout)


def _fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, dropout: float
) -> torch.Tensor:
    T = q.size(2)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=T > 1)
    if T == 1:  # one new query may look at every cached key: no mask needed
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
    # SDPA's is_causal aligns the mask top-left, wrong when queries start at `past`
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_mask(T, past, q.device), dropout_p=dropout
    )


def mlp(w: MLPWeights[torch.Tensor], x: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    # the tanh form is GPT-2's gelu_new, so imported weights give exactly GPT-2's outputs
    return _dropout(linear(w.c_proj, F.gelu(linear(w.c_fc, x), approximate="tanh")), dropout)


def block(
    w: BlockWeights[torch.Tensor],
    x: torch.Tensor,
    layer: int,
    cache: Cache | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache, attention, dropout)
    return x + mlp(w.mlp, norm(w.ln_2, x), dropout)


def transformer(
    w: ModelWeights[torch.Tensor],
    idx: torch.Tensor,
    cache: Cache | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones."""
    T = idx.size(1)
    start = first_position(cache, T, w.wpe.size(0))
    x = _dropout(F.embedding(idx, w.wte) + w.wpe[start : start + T], dropout)
    for layer, b in enumerate(w.h):
        x = block(b, x, layer, cache, attention, dropout)
    if cache is not None:
        cache.advance(T)
    return norm(w.ln_f, x)
