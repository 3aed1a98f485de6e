"""Log-probabilities of given tokens under a model, with gradients when the caller wants them (no I/O)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigpt.model.weights import ModelWeights


def token_logprobs(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    weights: ModelWeights[torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(y_t | x_<=t) at every position (B, T), 0 where y is -1 (not scored); through `weights` (a tree
    of the model's shape, say the reference's) in place of the model's own."""
    logits, _ = model(x, all_logits=True, weights=weights)
    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
    return -nll.view(y.shape)


def answer_logprobs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its targets summed over the row: (B,)."""
    return token_logprobs(model, x, y).sum(-1)
