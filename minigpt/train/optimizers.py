"""The optimizers a run can train with: AdamW alone, or Muon for the blocks' weight matrices and AdamW for the rest."""

from __future__ import annotations

import torch

from minigpt.model.weights import is_hidden_matrix
from minigpt.train.adamw import AdamW, GroupedOptimizer
from minigpt.train.config import TrainConfig
from minigpt.train.muon import Muon

Slots = dict[str, tuple[int, ...] | None]  # state name -> its shape (None: a one-element step count)


class Optimizers:
    """One or more optimizers stepped as one, each parameter owned by exactly one of them.

    Every parameter group holds "lr_scale", its peak learning rate over the run's `lr`, so the one schedule
    scales Muon's rate and AdamW's together.
    """

    def __init__(self, parts: list[GroupedOptimizer]) -> None:
        self.parts = parts
        self.param_groups = [group for part in parts for group in part.param_groups]
        self._owner = {p: part for part in parts for group in part.param_groups for p in group["params"]}

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr * group["lr_scale"]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def slots(self, param: torch.Tensor) -> Slots:
        """The state the optimizer owning `param` keeps for it, by name, with each one's shape: all a state
        file may hold for the parameter (nothing for a parameter none owns)."""
        part = self._owner.get(param)
        if isinstance(part, Muon):
            return dict(part.slots(param))
        if part is None:
            return {}
        return {"step": None, "exp_avg": tuple(param.shape), "exp_avg_sq": tuple(param.shape)}

    def state_items(self, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors the optimizer owning `param` keeps for it (none before its first step)."""
        part = self._owner.get(param)
        state = part.state.get(param, {}) if part is not None else {}
        return [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]

    def load_state(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self._owner[param].state[param] = state


def make_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, compute_dtype: torch.dtype | None = None
) -> Optimizers:
    """AdamW with decay on weight matrices (and the tied token embedding), not on wpe, biases or norms, and
    an untied LM head at cfg.head_lr; with cfg.optimizer "muon", the blocks' weight matrices go to Muon
    (minigpt.train.muon) at cfg.muon_lr instead, its iterations in `muon_dtype`'s dtype."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if cfg.optimizer == "muon" and is_hidden_matrix(n, p.dim())]
    taken = {id(p) for p in muon}
    head = [p for n, p in named if n == "lm_head.weight"]  # untied: a tied head is named as the embedding
    taken |= {id(p) for p in head}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    decay = [p for n, p in rest if p.dim() >= 2 and "wpe" not in n]
    no_decay = [p for n, p in rest if not (p.dim() >= 2 and "wpe" not in n)]
    assert cfg.lr is not None and cfg.head_lr is not None and cfg.beta1 is not None, (
        "make_optimizer needs a resolved config (with_recipe)"
    )
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": head, "weight_decay": cfg.weight_decay, "lr_scale": cfg.head_lr / cfg.lr},
    ]
    parts: list[GroupedOptimizer] = [AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))]
    if muon:
        assert cfg.muon_lr is not None, "make_optimizer needs a resolved config (with_recipe)"
        # Muon's update is orthogonalised, so its rate is its own; the schedule scales it with lr's
        group = {"params": muon, "lr_scale": cfg.muon_lr / cfg.lr}
        parts.append(
            Muon(
                [group], lr=cfg.muon_lr, weight_decay=cfg.weight_decay, orthogonalizer=cfg.orthogonalizer,
                normuon=cfg.normuon, dtype=muon_dtype(cfg.muon_dtype, compute_dtype),
            )
        )  # fmt: skip
    return Optimizers(parts)


def muon_dtype(setting: str, compute_dtype: torch.dtype | None) -> str:
    """--muon-dtype as Muon takes it: auto is bfloat16 for a run that computes in bf16, else Muon's own auto
    (bf16 on GPUs, float32 elsewhere). A CPU run's auto has been replaced by the faster dtype measured for it
    by then (minigpt.train.tuning)."""
    return "bfloat16" if setting == "auto" and compute_dtype == torch.bfloat16 else setting
