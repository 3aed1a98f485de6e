"""Initialisation: GPT-2's, and what the variants' and LoRA's tensors start as (no I/O).

GPT-2 draws every matrix from N(0, 0.02) and scales the residual projections (each block's c_proj) by
1/sqrt(2 n_layer), so that the residual stream's variance does not grow with depth; biases start at zero and
norm gains at one. `GPT.reset_parameters` calls `init_parameters`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn


@torch.no_grad()
def init_parameters(named: Iterable[tuple[str, nn.Parameter]], n_layer: int) -> None:
    """GPT-2 initialisation of a model's named parameters: N(0, 0.02), residual projections scaled by
    1/sqrt(2 n_layer); U-net skip weights 1 (modded-nanogpt's); LoRA's A as nn.Linear's default (uniform
    within 1/sqrt(in)) and B zero, so an adapter starts as no change. Score maps, then value embeddings
    (N(0, 0.02)) are drawn last, so a seed gives the other weights whatever the score and with or without
    value embeddings."""
    for name, p in sorted(named, key=lambda item: _init_order(item[0])):
        if ".attn.score" in name:
            _init_score_map(name, p)
        else:
            init_parameter(name, p, n_layer)


def _init_order(name: str) -> int:
    """0 for most parameters, 1 for a score map, 2 for a value embedding: the order they are drawn in."""
    return 2 if name.endswith("v_embed.weight") else int(".attn.score" in name)


def _init_score_map(name: str, p: torch.Tensor) -> None:
    """general's W starts as the identity, so general starts as dot and the runs differ by what training does
    with W; additive's maps start at N(0, 1/fan_in) (LeCun), keeping tanh's inputs at the scale of the
    queries and keys and the scores at the scale of tanh's outputs."""
    if name.endswith("attn.score.weight"):
        p.copy_(torch.eye(p.size(-1)).expand_as(p))
    else:
        nn.init.normal_(p, mean=0.0, std=p.size(-1) ** -0.5)


@torch.no_grad()
def init_parameter(name: str, p: torch.Tensor, n_layer: int) -> None:
    """One parameter's GPT-2 initialisation, by its name (LoRA's factors and skip weights included)."""
    if name.endswith("lora_A"):
        bound = 1.0 / math.sqrt(p.size(1))
        nn.init.uniform_(p, -bound, bound)
    elif name.endswith("lora_B"):
        nn.init.zeros_(p)
    elif name.endswith("c_proj.weight"):
        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
    elif p.dim() >= 2:
        nn.init.normal_(p, mean=0.0, std=0.02)
    elif name.endswith("bias"):
        nn.init.zeros_(p)
    else:  # norm gains, skip weights
        nn.init.ones_(p)


@torch.no_grad()
def zero_output_projections(model: nn.Module) -> None:
    """Zero every block's output projections (attention's and the MLP's c_proj) and an untied head (a tied
    one is the embedding, listed under its own name), so each block starts as the identity and the first
    logits are uniform (modded-nanogpt's init)."""
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            p.zero_()
