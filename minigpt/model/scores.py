"""Attention scores other than GPT-2's scaled dot product q·k/√d_head (no I/O).

dot, q·k (Luong et al. 2015); general, (Wq)·k (Luong et al. 2015), a d_head x d_head matrix W per head and
layer; additive, vᵀtanh(W₁q + W₂k) (Bahdanau et al. 2014). They join the default path at
`gpt.attention_logits`, which computes the scaled score and hands the others to `score_logits`; general's W
acts on the projected queries (`general_queries`, from `variants.qkv_variants`), so dot and general still
run through the fused kernel (unscaled), while additive, which has no kernel, always takes the explicit path.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from minigpt.model.memory import score_chunks
from minigpt.model.weights import AttentionWeights


class ScoreMap(nn.Module):
    """One of the attention score's per-head maps (`weights.score_shapes`), held as `weight`."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


def general_queries(w: AttentionWeights[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """general's Wq of the queries q (B, H, T, hd): W acts on the projected queries, so it folds into W_Q."""
    return q @ w.score_maps[0].mT


def score_logits(w: AttentionWeights[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Logits (B, H, T, S) of the queries q (B, H, T, hd) over the keys k (B, H, S, hd), both float32 or
    wider, by the layer's score: q·k (dot; general, whose W the queries carry) or additive's
    vᵀtanh(W₁q + W₂k), left -inf where no query of a chunk may look (the caller masks the rest)."""
    if w.score == "additive":
        maps = tuple(m.to(q.dtype) for m in w.score_maps)
        return _additive_logits(q, k, maps, w.window)
    return q @ k.transpose(-2, -1)


def _additive_logits(
    q: torch.Tensor, k: torch.Tensor, maps: tuple[torch.Tensor, ...], window: int
) -> torch.Tensor:
    """vᵀtanh(W₁q + W₂k) of every query and key, materialising the B·H·T·S·d_a pre-activations a chunk
    of queries at a time (`memory.score_chunks`). Under autograd each chunk is recomputed in the backward
    pass (checkpoint) rather than kept, so a training step holds one chunk's values, not every chunk's."""
    w1, w2, v = maps
    qa, ka = q @ w1.mT, (k @ w2.mT).unsqueeze(2)  # (B, H, T, d_a), (B, H, 1, S, d_a)
    B, H, T, da = qa.shape
    logits = qa.new_full((B, H, T, ka.size(3)), float("-inf"))
    grad = torch.is_grad_enabled() and (qa.requires_grad or ka.requires_grad)
    for t0, t1, k0, k1 in score_chunks(T, ka.size(3), window, B * H * da):
        part = (qa[:, :, t0:t1], ka[:, :, :, k0:k1], v)
        logits[:, :, t0:t1, k0:k1] = (
            checkpoint(_additive_chunk, *part, use_reentrant=False) if grad else _additive_chunk(*part)
        )
    return logits


def _additive_chunk(qa: torch.Tensor, ka: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vᵀtanh(qa + ka) for queries qa (B, H, Tc, d_a) and keys ka (B, H, 1, S, d_a): (B, H, Tc, S)."""
    pre = qa.unsqueeze(3) + ka  # (B, H, Tc, S, d_a): the memory `score_chunks` bounds
    return (pre.tanh_() @ v.mT.unsqueeze(1)).squeeze(-1)
