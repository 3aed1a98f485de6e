"""Tolerances from the arithmetic, not from one machine: how far a float32 forward pass may land from exact.

A sum of K products rounded in float32 is off by at most K·u times the sum of the products' magnitudes
(u = 2**-24, the unit roundoff; Higham's gamma_K), whatever order a BLAS adds them in and however many
threads share the sum. A logit goes through one such sum per matrix product along its path, so its error is
bounded by u times the sum of their inner dimensions (the depth of the computation) times the size of what is
summed, taken as the largest logit of a float64 reference (each layer's norm keeps activations on that
scale). Two float32 computations of one model (two engines, or minigpt and transformers) are each within
that bound of the float64 reference, so within twice it of each other. Observed errors sit at 5-25% of it.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from minigpt.model.config import GPTConfig

UNIT_ROUNDOFF = float(np.finfo(np.float32).eps) / 2  # 2**-24


def depth(config: GPTConfig) -> int:
    """The inner dimensions a logit's path sums over: per layer, the q/k/v projection (n_embd), the scores
    (head_dim), the weighted values (at most block_size keys), the output projection (n_embd), the MLP's two
    products (n_embd, then its hidden width); then the head (n_embd)."""
    C = config.n_embd
    per_layer = C + config.head_dim + config.block_size + C + C + config.d_ff
    return config.n_layer * per_layer + C


def float32_bound(config: GPTConfig, exact: Any) -> float:
    """How far float32 logits may be from `exact` (float64 logits of the same model and input)."""
    return UNIT_ROUNDOFF * depth(config) * float(np.abs(np.asarray(exact)).max())


def float64_logits(model: torch.nn.Module, ids: torch.Tensor, **kw: Any) -> np.ndarray:
    """The logits of `model` (left as it is) computed in float64: the reference both sides are held to."""
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        return exact(ids, **kw)[0].numpy()


def assert_near_exact(
    got: Any, exact: np.ndarray, config: GPTConfig, what: str = "", *, slack: float = 0.0
) -> None:
    """float32 logits `got` within the float32 bound (plus `slack`) of the float64 `exact` ones."""
    bound = float32_bound(config, exact) + slack
    error = float(np.abs(np.asarray(got, dtype=np.float64) - exact).max())
    assert error <= bound, f"{what}: {error:.2e} from float64, more than the bound {bound:.2e}"
