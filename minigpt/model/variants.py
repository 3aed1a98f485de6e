"""The smaller departures from GPT-2, each a few lines, joining the default path where `gpt` calls them
(no I/O). The larger ones have modules of their own: rotary positions (`rotary`), the attention scores
(`scores`).

- `qkv_variants` (from `gpt.qkv`): what later models do to a layer's queries, keys and values between their
  projection and their scores: value embeddings (modded-nanogpt) add a learned embedding of each token to
  its values; general's W acts on the queries (`scores`); QK-norm (Dehghani et al. 2023) normalises each
  head's queries and keys, so that the scores cannot grow with the weights; rotary positions turn both
  (`rotary`).
- `activation` (from `gpt.mlp`): ReLU² (So et al. 2021) or SwiGLU (Shazeer 2020) in place of GELU.
- `Skips` (from `gpt.transformer`): U-net skips (modded-nanogpt), the last n_layer/2 layers each adding,
  times a learned weight, the input of the layer mirroring it.
- `soft_cap` (from `gpt.head`): the logits soft-capped at a size (Gemma 2), cap * tanh(logits / cap).
- `add_attention_parameters` (from `gpt.CausalSelfAttention`): the tensors these variants add to a block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.model.config import GPTConfig
from minigpt.model.rotary import Rotary, rotate
from minigpt.model.scores import ScoreMap, general_queries
from minigpt.model.weights import AttentionWeights, MLPWeights, ModelWeights


def qkv_variants(
    w: AttentionWeights[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rotary | None,
    idx: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (B, H, T, hd), keys and values (B, n_kv_head, T, hd) with the layer's variants applied, in
    this order: value embeddings of the tokens idx (B, T), general's W, QK-norm, rotary positions."""
    if w.v_embed is not None and idx is not None:
        B, kv, T, hd = v.shape
        v = v + F.embedding(idx, w.v_embed).to(v.dtype).view(B, T, kv, hd).transpose(1, 2)
    if w.score == "general":
        q = general_queries(w, q)
    if w.q_norm is not None and w.k_norm is not None:  # QK-norm is always an RMSNorm over a head's hd
        q = F.rms_norm(q, (q.size(-1),), w.q_norm.weight, w.q_norm.eps)
        k = F.rms_norm(k, (k.size(-1),), w.k_norm.weight, w.k_norm.eps)
    if rope is not None:
        q, k = rotate(q, rope), rotate(k, rope)
    return q, k, v


def activation(w: MLPWeights[torch.Tensor], h: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """ReLU² of the up-projection h, or SwiGLU's silu(gate) * h, the gate a second product of the MLP's
    input (None where c_fc computes both: a decoding engine's fused form, the gate's outputs first)."""
    if w.activation == "relu2":
        return F.relu(h).square()
    if w.fused_gate:
        gate, h = h.chunk(2, dim=-1)
    return F.silu(gate) * h


class Skips:
    """U-net skips over one forward pass: `skips(layer, x)` is the input layer `layer` takes, x plus,
    times its weight, the input its mirror took (x itself where the model has no skips)."""

    def __init__(self, w: ModelWeights[torch.Tensor]) -> None:
        self.weights, self.pairs = w.skips, w.skip_pairs
        self.takes = {taker: (i, giver) for i, (giver, taker) in enumerate(w.skip_pairs)}
        self.inputs: list[torch.Tensor] = []  # the layers' inputs that later layers take back

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer in self.takes and self.weights is not None:
            i, giver = self.takes[layer]
            x = x + self.weights[i].to(x.dtype) * self.inputs[giver]
        if layer < len(self.pairs):
            self.inputs.append(x)
        return x


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """The logits squashed smoothly into (-cap, cap): near the identity for small logits."""
    return cap * torch.tanh(logits / cap)


def add_attention_parameters(attn: nn.Module, config: GPTConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Give a block's attention module the variants' tensors `shapes` (`weights.block_shapes`) lists:
    QK-norm's gains, the value embeddings' table, the score's maps."""
    if config.qk_norm:
        for name in ("q_norm", "k_norm"):
            (width,) = shapes[f"attn.{name}.weight"]
            setattr(attn, name, nn.RMSNorm(width, eps=config.layer_norm_eps))
    if "attn.v_embed.weight" in shapes:
        attn.v_embed = nn.Embedding(*shapes["attn.v_embed.weight"])
    for name, shape in shapes.items():
        if name.startswith("attn.score"):
            setattr(attn, name.split(".")[1], ScoreMap(shape))
