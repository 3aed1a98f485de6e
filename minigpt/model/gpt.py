"""The GPT, top to bottom: GPT-2's decoder-only transformer, each step named as a textbook names it (no I/O).

The default model is GPT-2 (Radford et al. 2019): each token's embedding plus its position's; n_layer
pre-norm blocks, each adding to that residual stream the output of causal multi-head self-attention, then
of a GELU MLP; a final LayerNorm; the LM head, the token embedding again (tied), scoring every vocabulary
entry. A config may depart from GPT-2 as later models do, each variant in a module of its own, joining this
path at one named point:

- positions: rotary angles on queries and keys instead of learned embeddings (`rotary`, from `embed`)
- norms and MLPs: RMSNorm instead of LayerNorm (`norm`), ReLU² or SwiGLU instead of GELU (`variants`)
- attention: fewer key/value heads than query heads, a sliding window (`attention_mask`), value embeddings
  and QK-norm (`variants`, from `qkv`), the dot, general or additive score (`scores`, from `attention_logits`)
- U-net skips between layers (`variants`, from `transformer`); an untied head whose logits may be
  soft-capped (`variants`, from `head`); no biases

The computation is written once, as functions over the `ModelWeights` tree that `GPT.weights()` reads from
the modules at the bottom (which hold the parameters under GPT-2's names); the NumPy engine mirrors it
function by function. Training, prefill, decoding through a KV cache (`kv_cached`), attention maps, int8
weights (`quantize`) and LoRA (`adapters`) all run it; beside it are the fused attention kernel
(`fused_attention`), the chunked loss (`head_loss`), initialisation (`init`) and loading (`build`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from minigpt.model.adapters import adapted_weights, add_adapters, low_rank
from minigpt.model.config import GPTConfig
from minigpt.model.fused_attention import fused_attention
from minigpt.model.head_loss import head_loss
from minigpt.model.init import init_parameters
from minigpt.model.kv_cached import cached_keys, new_cache, positions
from minigpt.model.kvcache import KVCache, first_position
from minigpt.model.lora import LoRAConfig, base_config
from minigpt.model.quantize import int8_linear
from minigpt.model.rotary import Rotary, angles
from minigpt.model.scores import score_logits
from minigpt.model.variants import Skips, activation, add_attention_parameters, qkv_variants, soft_cap
from minigpt.model.weights import (
    AttentionWeights,
    BlockWeights,
    LinearWeights,
    MLPWeights,
    ModelWeights,
    NormWeights,
    block_shapes,
    expected_shapes,
    weights_by_name,
)

Cache = KVCache[Tensor]


def embed(
    w: ModelWeights[Tensor], idx: Tensor, cache: Cache | None = None, dropout: float = 0.0
) -> tuple[Tensor, Rotary | None]:
    """The tokens idx (B, T), placed after the positions a cache holds, as vectors (B, T, C): each token's
    row of the token embedding plus its position's row of the position embedding (GPT-2's learned
    positions). A rotary model has no position table; it returns the angles its blocks turn by."""
    T = idx.size(1)
    start = first_position(cache, T, None if w.wpe is None else w.wpe.size(0))
    x = F.embedding(idx, w.wte)
    if w.wpe is not None:
        x = x + w.wpe[positions(start, T, x.device)]  # a slice, or each row's own position
    rope = None if w.rope_base is None else angles(w.rope_base, w.head_dim, start, T, x.device)
    return _dropout(x, dropout), rope


def qkv(
    w: AttentionWeights[Tensor], x: Tensor, rope: Rotary | None = None, idx: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries (B, H, T, hd), keys and values (B, n_kv_head, T, hd) of x (B, T, C) (idx: the tokens,
    for value embeddings)."""
    B, T, C = x.shape
    hd = C // w.n_head
    # the query, key and value projections: one product with c_attn computes all three side by side, n_head
    # query heads, then n_kv_head key heads and as many value heads (fewer: grouped-query attention)
    q, k, v = linear(w.c_attn, x).split([w.n_head * hd, w.n_kv_head * hd, w.n_kv_head * hd], dim=-1)
    # each split into its heads, (B, heads, T, hd): every head attends on its own, in hd dimensions
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    return qkv_variants(w, q, k, v, rope, idx)  # value embeddings, general's W, QK-norm, rotary


def causal_attention(
    w: AttentionWeights[Tensor], q: Tensor, k: Tensor, v: Tensor, seen: Tensor | None = None,
    probs: list[Tensor] | None = None, dropout: float = 0.0,
) -> Tensor:  # fmt: skip
    """Every head's output (B, H, T, hd): for each query, the values of the positions it may see, weighted
    by how well its query matches their keys. q (B, H, T, hd) over k, v (B, n_kv_head, S, hd), the queries
    standing at the last T of the S positions (`seen`: the cache slots each row may see, where the rows
    stand at different positions). With a `probs` list the weights are computed here and appended to it,
    (B, H, T, S), so that an attention map shows the very attention the model runs."""
    T, S = q.size(2), k.size(2)
    if probs is None and w.score != "additive":
        # the fast path: torch's fused kernel computes the lines below in one call, never holding the (T, S)
        # weights: F.scaled_dot_product_attention(q, k, v, is_causal=True) where T queries meet as many keys
        # within the window, the mask drawn where they follow cached keys (is_causal aligns it top-left)
        mask = seen  # one new query sees every key it is handed, or the cache slots `seen` marks
        if T > 1 and not (S == T and w.window >= T):
            mask = attention_mask(T, S, w.window, q.device)
        scale = None if w.score == "scaled" else 1.0  # dot and general leave q·k unscaled
        return fused_attention(q, k, v, mask, T > 1 and mask is None, dropout, scale)
    # grouped-query attention: each key/value head serves n_head / n_kv_head query heads
    groups = w.n_head // w.n_kv_head
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # the scaled scores: how well each query matches each key, q·k/√hd, (B, H, T, S)
    scores = attention_logits(w, q, k)
    # the causal mask: a query sees itself and the positions before it (the latest `window`), never a
    # later one, so that training predicts every position at once, each from its past alone
    if T > 1:
        scores = scores.masked_fill(~attention_mask(T, S, w.window, q.device), float("-inf"))
    elif seen is not None:  # one new token a row, the rows at different positions
        scores = scores.masked_fill(~seen, float("-inf"))
    # the softmax: each query's scores become weights, positive and summing to 1
    weights = scores.softmax(dim=-1)
    if probs is not None:
        probs.append(weights)
    # the weighted sum of the values: what each query gathers from the positions it attends to
    return _dropout(weights, dropout).to(v.dtype) @ v


def attention_logits(w: AttentionWeights[Tensor], q: Tensor, k: Tensor) -> Tensor:
    """The scores (B, H, T, S), float32 or wider, of the queries q (B, H, T, hd) over the keys k (one head
    per query head): GPT-2's q·k/√hd, or the layer's other score (`scores.score_logits`)."""
    dtype = torch.promote_types(q.dtype, torch.float32)  # half precision upcast; a float64 model stays
    q, k = q.to(dtype), k.to(dtype)
    if w.score != "scaled":
        return score_logits(w, q, k)
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))


def attention_mask(queries: int, keys: int, window: int, device: torch.device) -> Tensor:
    """(queries, keys) booleans, True where a query may see a key: the keys are the latest positions in
    order and the queries the last of them; each sees itself and the window - 1 positions before it."""
    offset = keys - queries
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=offset).triu(diagonal=offset - window + 1)


def attend(
    w: AttentionWeights[Tensor], x: Tensor, layer: int, cache: Cache | None = None,
    rope: Rotary | None = None, attention: list[Tensor] | None = None, dropout: float = 0.0,
    idx: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Causal self-attention of x (B, T, C) over itself and, with a cache, the positions cached before;
    `attention`: a list each layer appends its weights to; idx: the tokens, for value embeddings."""
    B, T, C = x.shape
    q, k, v = qkv(w, x, rope, idx)
    seen = None
    if cache is not None:  # the KV-cached path: the keys and values of earlier positions join these
        k, v, seen = cached_keys(cache, layer, k, v, q.dtype)
    y = causal_attention(w, q, k, v, seen, attention, dropout)
    # the heads concatenated: each position's H outputs side by side, (B, T, C) (a view for one new token)
    y = y.transpose(1, 2).reshape(B, T, C)
    # the output projection: the heads' outputs mixed back into the residual stream
    return _dropout(linear(w.c_proj, y), dropout)


def block(
    w: BlockWeights[Tensor], x: Tensor, layer: int, cache: Cache | None = None, rope: Rotary | None = None,
    attention: list[Tensor] | None = None, dropout: float = 0.0, idx: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """A pre-norm transformer block. The residual: attention, then the MLP, each reads the stream x
    normalised and adds its output back to x, so every layer's output has a straight path to the loss."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache, rope, attention, dropout, idx)
    return x + mlp(w.mlp, norm(w.ln_2, x), dropout)


def mlp(w: MLPWeights[Tensor], x: Tensor, dropout: float = 0.0) -> Tensor:
    """The feed-forward layer, each position on its own: up to d_ff dimensions, GELU, back down to C."""
    h = linear(w.c_fc, x)
    if w.activation == "gelu":  # the tanh form is GPT-2's gelu_new: imported weights give its outputs
        h = F.gelu(h, approximate="tanh")
    else:  # ReLU², or SwiGLU, whose gate is a second product of x
        h = activation(w, h, None if w.c_gate is None else linear(w.c_gate, x))
    return _dropout(linear(w.c_proj, h), dropout)


def transformer(
    w: ModelWeights[Tensor], idx: Tensor, cache: Cache | None = None,
    attention: list[Tensor] | None = None, dropout: float = 0.0,
) -> Tensor:  # fmt: skip
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones."""
    x, rope = embed(w, idx, cache, dropout)
    skips = Skips(w)  # U-net skips: what the first layers took, carried to their mirrors (none by default)
    for layer, b in enumerate(w.h):
        x = block(b, skips(layer, x), layer, cache, rope, attention, dropout, idx)
    if cache is not None:
        cache.advance(idx.size(1))
    # the final norm: the last block's output normalised before the head reads it
    return norm(w.ln_f, x)


def head(w: ModelWeights[Tensor], x: Tensor) -> Tensor:
    """The logits (..., V) of hidden states x: the LM head scores each vocabulary entry (the token embedding
    itself when tied), soft-capped where the model caps them."""
    logits = F.linear(x, w.lm_head)
    return logits if w.logit_cap is None else soft_cap(logits, w.logit_cap)


def norm(w: NormWeights[Tensor], x: Tensor) -> Tensor:
    """LayerNorm, GPT-2's: each vector centred, scaled to unit variance, then given a learned gain and bias;
    RMSNorm (`rms`) only scales."""
    if w.rms:
        return F.rms_norm(x, (x.size(-1),), w.weight, w.eps)
    return F.layer_norm(x, (x.size(-1),), w.weight, w.bias, w.eps)


def linear(w: LinearWeights[Tensor], x: Tensor) -> Tensor:
    """x Wᵀ + b, every projection of the model; an int8 layer computes it in `quantize`, and a LoRA
    adapter adds its update (`adapters`)."""
    if w.scale is not None:
        return int8_linear(w, x)
    # an input-major weight (a decoding engine's layout) is the transpose of torch's
    y = F.linear(x, w.weight.t() if w.input_major else w.weight, w.bias)
    return y if w.lora is None else low_rank(w.lora, x, y)


def _dropout(x: Tensor, p: float) -> Tensor:
    return F.dropout(x, p) if p else x  # inference passes p=0: not even a call


# --- the parameters, under GPT-2's names: `GPT.weights()` reads them into the tree the functions take ---

Shapes = dict[str, tuple[int, ...]]  # a block's tensors by name, as `weights.block_shapes` states them


def _norm(config: GPTConfig, shapes: Shapes, name: str) -> nn.Module:
    (width,) = shapes[f"{name}.weight"]
    if config.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=config.layer_norm_eps)
    return nn.LayerNorm(width, eps=config.layer_norm_eps, bias=f"{name}.bias" in shapes)


def _linear(shapes: Shapes, name: str) -> nn.Linear:
    out_features, in_features = shapes[f"{name}.weight"]
    return nn.Linear(in_features, out_features, bias=f"{name}.bias" in shapes)


class CausalSelfAttention(nn.Module):
    """Parameters of causal self-attention (computed by `attend`)."""

    def __init__(self, config: GPTConfig, shapes: Shapes) -> None:
        super().__init__()
        self.c_attn = _linear(shapes, "attn.c_attn")  # queries, keys and values
        self.c_proj = _linear(shapes, "attn.c_proj")
        add_attention_parameters(self, config, shapes)  # QK-norm, value embeddings, the score's maps


class MLP(nn.Module):
    """Parameters of the feed-forward layer (computed by `mlp`)."""

    def __init__(self, shapes: Shapes) -> None:
        super().__init__()
        self.c_fc = _linear(shapes, "mlp.c_fc")
        if "mlp.c_gate.weight" in shapes:  # SwiGLU's gate
            self.c_gate = _linear(shapes, "mlp.c_gate")
        self.c_proj = _linear(shapes, "mlp.c_proj")


class Block(nn.Module):
    """Parameters of a pre-norm transformer block (computed by `block`), laid out as `block_shapes` says."""

    def __init__(self, config: GPTConfig, shapes: Shapes) -> None:
        super().__init__()
        self.ln_1 = _norm(config, shapes, "ln_1")
        self.attn = CausalSelfAttention(config, shapes)
        self.ln_2 = _norm(config, shapes, "ln_2")
        self.mlp = MLP(shapes)


class GPT(nn.Module):
    """Token (+ learned position) embeddings, n_layer pre-norm blocks, final norm, LM head.

    With `lora`, the base weights are frozen and each targeted layer holds the adapter's trainable tensors
    beside its weight (`adapters`): `config` is the adapted model's shape, new token rows included.
    """

    def __init__(self, config: GPTConfig, lora: LoRAConfig | None = None) -> None:
        super().__init__()
        self.config, self.lora = config, lora
        # what a weights file holds (a LoRA model's base: the new rows are the adapter's)
        shapes = expected_shapes(base_config(config, lora) if lora is not None else config)
        vocab, width = shapes["transformer.wte.weight"]
        modules: dict[str, nn.Module] = {"wte": nn.Embedding(vocab, width)}
        if "transformer.wpe.weight" in shapes:
            modules["wpe"] = nn.Embedding(*shapes["transformer.wpe.weight"])
        block = block_shapes(config)
        modules["h"] = nn.ModuleList(Block(config, block) for _ in range(config.n_layer))
        modules["ln_f"] = _norm(config, shapes, "transformer.ln_f")
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if "skip_weights" in shapes:
            self.skip_weights = nn.Parameter(torch.empty(shapes["skip_weights"]))
        if lora is not None:
            add_adapters(self, lora)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation, and the variants' (`init.init_parameters`)."""
        init_parameters(self.named_parameters(), self.config.n_layer)

    def num_params(self) -> int:
        """Parameters the module holds, a tied tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def weights(self) -> ModelWeights[Tensor]:
        """The parameters as the named tree the forward pass reads (the tensors themselves, not copies).

        It holds the parameter objects of this moment: in-place updates (training steps) show through,
        parameters replaced afterwards (load_state_dict(assign=True)) do not: read it again then.
        """
        tensors = dict(self.named_parameters())
        if self.lora is None:
            return weights_by_name(self.config, tensors)
        return adapted_weights(self.config, tensors, self.lora)

    def new_cache(self, batch: int, dtype: torch.dtype | None = None, capacity: int | None = None) -> Cache:
        """An empty KV cache of `batch` rows in `dtype` (None: the model's) on the model's device, each layer
        holding at most `capacity` positions (None: its window)."""
        return new_cache(self.config, self.transformer.wte.weight, batch, dtype, capacity)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, kv_cache: Cache | None = None,
        all_logits: bool = False, attention: list[Tensor] | None = None,
        weights: ModelWeights[Tensor] | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
        """Return (logits, loss): training, prefill and single-token decoding all run through here.

        With targets (B, T): (None, the mean cross-entropy; targets of -1 are ignored), from head_loss,
        which never holds the logits whole.
        Without: logits of the last position only, (B, V), unless all_logits asks for (B, T, V).
        With a kv_cache, idx holds only the new tokens, placed after kv_cache.pos cached ones.
        With an `attention` list, every layer appends its attention probabilities (B, H, T, pos + T).
        `weights`: this model's `weights()`, read once by a caller that steps many times.
        """
        w = self.weights() if weights is None else weights
        dropout = self.config.dropout if self.training else 0.0
        x = transformer(w, idx, kv_cache, attention, dropout)
        if targets is not None:
            return None, head_loss(w, x, targets)
        return head(w, x if all_logits else x[:, -1, :]), None
