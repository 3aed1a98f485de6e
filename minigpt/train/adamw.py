"""AdamW through torch's fused kernel, and the parameter groups minigpt's optimizers share.

Why not torch.optim: its Optimizer base class imports torch._dynamo the first time an optimizer is built or
stepped (its methods are wrapped to keep the compiler out), a large share of every `minigpt train`'s
start-up on a CPU, spent on a compiler a run without --compile never uses. The update is
the same kernel `torch.optim.AdamW(fused=True)` calls, with the step count kept as it keeps it, so the two
agree bitwise (tests/test_optimizers.py) and a run's optimizer state file holds the same tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch


class GroupedOptimizer:
    """Parameter groups (each a dict: "params" and its settings, defaults filled in) and per-parameter
    state, the two things torch.optim.Optimizer holds that minigpt uses; subclasses define step()."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], defaults: dict[str, Any]) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups: list[dict[str, Any]] = [
            {**defaults, **group, "params": list(group["params"])} for group in groups
        ]
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def step(self) -> None:
        raise NotImplementedError


class AdamW(GroupedOptimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), every group's parameters updated by one call
    of torch's fused kernel per device and dtype."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_kind.setdefault((p.device, p.dtype), []).append(p)
            for params in by_kind.values():
                self._update(params, group)

    def _update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            # as torch keeps them for its fused kernel: a float32 count on the parameter's device
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
