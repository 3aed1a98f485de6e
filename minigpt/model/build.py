"""A GPT and its stored tensors: what a checkpoint holds, and a model built from it without a wasted random
initialisation (no I/O: the caller reads and writes the files).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.lora import LoRAConfig
from minigpt.model.weights import check_shapes, is_adapter_tensor


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # random init of a large model costs seconds, and the meta device pulls in torch._dynamo for
    # nn.Embedding; loading only needs the storage, so the init methods become no-ops for a moment
    classes = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, GPT)
    saved = [c.reset_parameters for c in classes]
    try:
        for c in classes:
            c.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for c, fn in zip(classes, saved, strict=True):
            c.reset_parameters = fn  # type: ignore[method-assign]


def uninitialized(config: GPTConfig, lora: LoRAConfig | None = None) -> GPT:
    """A GPT with allocated but uninitialised weights, fast to build when loaded weights replace them."""
    with _skip_init():
        return GPT(config, lora)


def model_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """What a checkpoint of the model holds: its state dict with GPT-2 names, the tied head left out (it is
    wte); for a model with LoRA adapters, the adapter's tensors only (the base stays in its own run)."""
    if model.lora is not None:
        whole = model.lora.whole
        return {n: p for n, p in model.named_parameters() if is_adapter_tensor(n) or n in whole}
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def build_model(
    config: GPTConfig, tensors: dict[str, torch.Tensor], source: Path, device: str = "cpu"
) -> GPT:
    """Build a GPT from stored tensors, checking names and shapes, without a wasted random init."""
    check_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    model = uninitialized(config)
    state = {k: v.float() for k, v in tensors.items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model.to(device)
