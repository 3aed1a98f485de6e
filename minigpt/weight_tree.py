"""The tree of a GPT's tensors by GPT-2 name, the one both engines compute over (no torch here).

`model.py` (torch) and `engines/numpy.py` run the same forward pass over this tree, each with its own
array type: named fields rather than module attribute lookups, which a single-token decode step would
pay for a few hundred times. Every linear weight keeps torch's (out, in) layout: y = x @ weight.T + bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from minigpt.config import GPTConfig

__all__ = [
    "AttentionWeights",
    "BlockWeights",
    "LinearWeights",
    "MLPWeights",
    "ModelWeights",
    "NormWeights",
    "weights_by_name",
]

A = TypeVar("A", bound=Any)  # torch.Tensor or np.ndarray


@dataclass(frozen=True, slots=True)
class LinearWeights(Generic[A]):
    weight: A  # (out, in)
    bias: A | None


@dataclass(frozen=True, slots=True)
class NormWeights(Generic[A]):
    weight: A
    bias: A | None
    eps: float


@dataclass(frozen=True, slots=True)
class AttentionWeights(Generic[A]):
    c_attn: LinearWeights[A]  # queries, keys and values of every head, in that order
    c_proj: LinearWeights[A]
    n_head: int


@dataclass(frozen=True, slots=True)
class MLPWeights(Generic[A]):
    c_fc: LinearWeights[A]
    c_proj: LinearWeights[A]


@dataclass(frozen=True, slots=True)
class BlockWeights(Generic[A]):
    ln_1: NormWeights[A]
    attn: AttentionWeights[A]
    ln_2: NormWeights[A]
    mlp: MLPWeights[A]


@dataclass(frozen=True, slots=True)
class ModelWeights(Generic[A]):
    wte: A
    wpe: A
    h: tuple[BlockWeights[A], ...]
    ln_f: NormWeights[A]
    lm_head: A  # wte itself when the embeddings are tied


def weights_by_name(config: GPTConfig, tensors: Mapping[str, A]) -> ModelWeights[A]:
    """The tree of `tensors` named as GPT-2 names them; absent biases are None, an absent head is wte."""

    def linear(name: str) -> LinearWeights[A]:
        return LinearWeights(tensors[f"{name}.weight"], tensors.get(f"{name}.bias"))

    def norm(name: str) -> NormWeights[A]:
        return NormWeights(tensors[f"{name}.weight"], tensors.get(f"{name}.bias"), config.layer_norm_eps)

    def block(p: str) -> BlockWeights[A]:
        attn = AttentionWeights(linear(f"{p}.attn.c_attn"), linear(f"{p}.attn.c_proj"), config.n_head)
        mlp = MLPWeights(linear(f"{p}.mlp.c_fc"), linear(f"{p}.mlp.c_proj"))
        return BlockWeights(norm(f"{p}.ln_1"), attn, norm(f"{p}.ln_2"), mlp)

    wte = tensors["transformer.wte.weight"]
    return ModelWeights(
        wte=wte,
        wpe=tensors["transformer.wpe.weight"],
        h=tuple(block(f"transformer.h.{i}") for i in range(config.n_layer)),
        ln_f=norm("transformer.ln_f"),
        lm_head=tensors.get("lm_head.weight", wte),
    )
