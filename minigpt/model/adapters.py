"""LoRA on the torch model: the adapter tensors a GPT carries, and the low-rank update (no I/O).

A LoRA run freezes the base weights and trains, beside each targeted linear layer's weight W, a `lora_A`
(rank x in) and a `lora_B` (out x rank): the layer computes x Wᵀ + b + (alpha / rank) (x Aᵀ) Bᵀ, and B starts
at zero, so training starts from the base model exactly. Tokens the fine-tuning adds get trainable rows
(`added`) appended to the embedding and an untied head. The computation meets it at one point, `gpt.linear`,
which adds a layer's update through `low_rank`; the model gets the tensors where it is built (`add_adapters`,
from `GPT.__init__`) and hands them to that point where its weights are read (`adapted_weights`, from
`GPT.weights`). What the adapter is (targets, files, merging into a plain model) is `minigpt.model.lora`'s,
which needs no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.model.config import GPTConfig
from minigpt.model.init import init_parameter
from minigpt.model.lora import LoRAConfig, join_added_rows
from minigpt.model.weights import LowRank, ModelWeights, is_adapter_tensor, weights_by_name


def add_adapters(model: nn.Module, lora: LoRAConfig) -> None:
    """Freeze the model's base weights and give the targeted layers of every block (and the new rows)
    trainable tensors, uninitialised."""
    model.requires_grad_(False)
    for name in lora.whole:
        model.get_parameter(name).requires_grad_(True)
    for block in model.get_submodule("transformer.h"):
        for target in lora.targets:
            layer = block.get_submodule(target)
            layer.lora_A = nn.Parameter(torch.empty(lora.rank, layer.in_features))
            layer.lora_B = nn.Parameter(torch.empty(layer.out_features, lora.rank))
    if lora.new_rows:
        embedding = model.get_submodule("transformer.wte")
        head = model.get_submodule("lm_head")
        for module in [embedding] + ([] if head.weight is embedding.weight else [head]):  # a tied head: wte
            module.added = nn.Parameter(torch.empty(lora.new_rows, embedding.weight.size(1)))


def adapted_weights(
    config: GPTConfig, tensors: Mapping[str, torch.Tensor], lora: LoRAConfig
) -> ModelWeights[torch.Tensor]:
    """The weight tree of a model with adapters: each adapted layer carries its `LowRank` update, and the
    new rows join the frozen ones on every call, so their gradient reaches `added`."""
    return weights_by_name(config, join_added_rows(tensors, torch.cat), lora.scale)


def low_rank(w: LowRank[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, a linear layer's output for x, plus its adapter's update scale * (x Aᵀ) Bᵀ."""
    # the scale goes on the rank-r product, and the update is added in place (linear's backward needs its
    # input, not its output): one full-width temporary, not three
    return y.add_(F.linear(F.linear(x, w.a) * w.scale, w.b))


@torch.no_grad()
def init_adapters(model: nn.Module, n_layer: int) -> None:
    """Initialise only the adapter's tensors of a model of n_layer blocks (the base weights loaded into an
    uninitialised model)."""
    for name, p in model.named_parameters():
        if is_adapter_tensor(name):
            init_parameter(name, p, n_layer)
