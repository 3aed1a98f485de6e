"""Muon for the blocks' weight matrices: momentum, then the update's polar factor (approximately), so every
direction of the matrix moves by about as much (Keller Jordan's Muon).

Two ways to approximate the polar factor, each five odd quintic polynomials applied to the singular values:
Newton-Schulz with one fixed quintic (Keller Jordan's published coefficients, as `torch.optim.Muon` has them),
or Polar Express (Amsel et al. 2025), a new quintic each iteration, the one that maps the interval the
singular values are known to lie in closest to 1 in the worst case. NorMuon (Li et al. 2025) then divides each
row (neuron) of the update by the root of its running mean square, so no neuron's update dominates.

The iterations run in bf16 on GPUs; on the CPU in whichever of float32 and bf16 a training run measured
faster on its machine (`minigpt.train.tuning`: a CPU without bf16 instructions emulates bf16 matrix
products, many times slower, so there it stays float32); `--muon-dtype` picks. Matrices of one shape are
orthogonalised together, one batched product per iteration.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import torch

from minigpt.train.adamw import GroupedOptimizer
from minigpt.train.config import ORTHOGONALIZERS

NS_QUINTIC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's, the coefficients torch.optim.Muon uses
STEPS = 5
POLAR_LOWER = 1e-3  # Polar Express's assumed smallest singular value after normalising (the paper's choice)
POLAR_SAFETY = 1.01  # each polynomial is applied to x / 1.01, so round-off just above the interval is safe
NORMUON_BETA2 = 0.95  # NorMuon's decay of each row's mean square (the paper's default)
NORMUON_EPS = 1e-8
EPS = 1e-7  # the least Frobenius norm divided by (torch.optim.Muon's)

Quintic = tuple[float, float, float]  # p(x) = a x + b x^3 + c x^5


def _minimax_quintic(lower: float, upper: float) -> Quintic:
    """The odd quintic p minimising max |1 - p(x)| over [lower, upper], by the Remez exchange algorithm:
    the optimum equioscillates at 4 points (3 coefficients and the error), the two ends and p's two
    interior extrema."""
    points = np.array([lower, lower + 0.25 * (upper - lower), lower + 0.75 * (upper - lower), upper])
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    coefficients = np.zeros(3)
    for _ in range(100):
        system = np.stack([points, points**3, points**5, signs], axis=1)
        *coefficients, _error = np.linalg.solve(system, np.ones(4))
        a, b, c = coefficients
        roots = np.roots([5 * c, 0.0, 3 * b, 0.0, a])  # p'(x) = a + 3b x^2 + 5c x^4
        inside = np.sort(roots[(abs(roots.imag) < 1e-12) & (roots.real > lower) & (roots.real < upper)].real)
        if len(inside) != 2:
            break
        moved = np.array([lower, *inside, upper])
        if np.allclose(moved, points, rtol=0.0, atol=1e-14):
            break
        points = moved
    return float(coefficients[0]), float(coefficients[1]), float(coefficients[2])


def _range(q: Quintic, lower: float, upper: float) -> tuple[float, float]:
    """The smallest and largest value of q over [lower, upper] (at an end or a critical point)."""
    a, b, c = q
    roots = np.roots([5 * c, 0.0, 3 * b, 0.0, a])
    xs = [lower, upper, *(r.real for r in roots if abs(r.imag) < 1e-12 and lower < r.real < upper)]
    values = [a * x + b * x**3 + c * x**5 for x in xs]
    return min(values), max(values)


@functools.cache
def polar_express(
    steps: int = STEPS, lower: float = POLAR_LOWER, safety: float = POLAR_SAFETY
) -> tuple[Quintic, ...]:
    """Polar Express's quintics: each the minimax one for the interval the previous left the singular values
    in (starting from [lower, 1]), applied to x / safety; the next interval is its range over this one."""
    low, high = lower, 1.0
    out: list[Quintic] = []
    for _ in range(steps):
        a, b, c = _minimax_quintic(low, high)
        q = (a / safety, b / safety**3, c / safety**5)
        low, high = _range(q, low, high)
        out.append(q)
    return tuple(out)


def quintics(orthogonalizer: str) -> tuple[Quintic, ...]:
    return polar_express() if orthogonalizer == "polar-express" else (NS_QUINTIC,) * STEPS


def orthogonalize(g: torch.Tensor, polynomials: tuple[Quintic, ...]) -> torch.Tensor:
    """The approximate polar factor of each matrix of g (k, m, n): divided by its Frobenius norm (so its
    singular values are at most 1), then X <- aX + (b XXᵀ + c (XXᵀ)²) X per quintic, over the shorter side."""
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=EPS)
    for a, b, c in polynomials:
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _shape_scale(shape: torch.Size) -> float:
    """torch.optim.Muon's rate adjustment ("original"): sqrt(max(1, rows / columns))."""
    return math.sqrt(max(1.0, shape[0] / shape[1]))


class Muon(GroupedOptimizer):
    """Muon with Nesterov momentum 0.95 and decoupled weight decay, like torch.optim.Muon, with a choice of
    orthogonaliser and NorMuon's row normalisation; the update has the size torch's would (NorMuon's is
    rescaled to the Frobenius norm of a polar factor, so --muon-lr means the same with it)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        orthogonalizer: str = "newton-schulz",
        normuon: bool = False,
        dtype: str = "auto",
    ) -> None:
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"unknown orthogonalizer {orthogonalizer!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum)
        super().__init__(params, defaults)
        self.polynomials = quintics(orthogonalizer)
        self.normuon = normuon
        self.dtype = dtype

    def slots(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The state this optimizer keeps for `param` and each one's shape."""
        shapes = {"momentum_buffer": tuple(param.shape)}
        if self.normuon:
            shapes["row_mean_square"] = (param.size(0),)
        return shapes

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            by_shape: dict[torch.Size, list[torch.Tensor]] = {}
            for p in params:
                by_shape.setdefault(p.shape, []).append(p)
            for same in by_shape.values():
                self._step_shape(same, group)

    def _step_shape(self, params: list[torch.Tensor], group: dict) -> None:
        momentum = group["momentum"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(buf, momentum))  # Nesterov
        stacked = torch.stack(updates)
        ortho = orthogonalize(stacked.to(self._work_dtype(stacked.device)), self.polynomials)
        if self.normuon:
            ortho = self._normalise_rows(params, ortho.float())
        lr, decay = group["lr"], group["weight_decay"]
        scale = lr * _shape_scale(params[0].shape)
        for p, u in zip(params, ortho.unbind(0), strict=True):
            p.mul_(1 - lr * decay)
            p.add_(u.to(p.dtype), alpha=-scale)

    def _work_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the iterations: bf16 on GPUs and float32 elsewhere, unless `dtype` names one."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    def _normalise_rows(self, params: list[torch.Tensor], ortho: torch.Tensor) -> torch.Tensor:
        """NorMuon: each row over the root of its running mean square, then the whole update rescaled to
        the Frobenius norm of a polar factor, sqrt(min(rows, columns))."""
        squares = ortho.square().mean(dim=-1)  # (k, rows)
        rows = []
        for p, sq in zip(params, squares.unbind(0), strict=True):
            state = self.state[p]
            if "row_mean_square" not in state:
                state["row_mean_square"] = torch.zeros(p.size(0), dtype=p.dtype, device=p.device)
            v = state["row_mean_square"]
            v.lerp_(sq.to(v.dtype), 1 - NORMUON_BETA2)
            rows.append(v)
        normalised = ortho / (torch.stack(rows).float().sqrt()[..., None] + NORMUON_EPS)
        target = math.sqrt(min(ortho.shape[-2:]))
        return normalised * (target / (torch.linalg.matrix_norm(normalised, keepdim=True) + EPS))
