"""A GPT's named weight tensors: the names and shapes a config implies (for the model to build and a file to
be checked against), and the tree both engines compute over; no torch.

`minigpt.model.gpt` (torch) and `minigpt.generate.engines.numpy_engine` run the same forward pass over this tree, each with its own
array type: named fields rather than module attribute lookups, which a single-token decode step would
pay for a few hundred times. A linear weight keeps torch's (out, in) layout, y = x @ weight.T + bias, as
the file stores it; a decoding engine may hold it input-major instead and fuse SwiGLU's two input
projections into one (`for_decoding`), the same arithmetic in the form its matrix-vector products stream
fastest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig

A = TypeVar("A", bound=Any)  # torch.Tensor or np.ndarray

QUANTIZATIONS = ("none", "int8")  # the forms a linear layer's weight can be decoded in


@dataclass(frozen=True, slots=True)
class LowRank(Generic[A]):
    """A LoRA update of a linear layer (minigpt.model.lora): y += scale * (x a^T) b^T."""

    a: A  # (rank, in)
    b: A  # (out, rank)
    scale: float  # alpha / rank


@dataclass(frozen=True, slots=True)
class LinearWeights(Generic[A]):
    weight: A  # (out, in), or (in, out) when input_major, or the NumPy engine's panels (`panelled`); int8 when quantized
    bias: A | None
    scale: A | None = None  # (out,) per-channel scales of an int8 weight (minigpt.model.quantize), else None
    input_major: bool = False  # weight stored transposed: y = x @ weight + bias
    lora: LowRank[A] | None = None  # a trained adapter's update (training only: inference merges it)


@dataclass(frozen=True, slots=True)
class NormWeights(Generic[A]):
    weight: A
    bias: A | None
    eps: float
    rms: bool  # RMSNorm (scale only) rather than LayerNorm (centre, then scale)


@dataclass(frozen=True, slots=True)
class AttentionWeights(Generic[A]):
    c_attn: LinearWeights[A]  # queries of n_head heads, then keys and values of n_kv_head heads
    c_proj: LinearWeights[A]
    n_head: int
    n_kv_head: int
    window: int  # the latest positions a query sees, itself included
    q_norm: NormWeights[A] | None  # QK-norm: RMSNorm over each head's dimensions
    k_norm: NormWeights[A] | None
    score: str = "scaled"  # how a query scores a key (GPTConfig.attn_score)
    score_maps: tuple[A, ...] = ()  # its per-head maps, as `score_shapes` lists them
    v_embed: A | None = None  # value embeddings (vocab, n_kv_head * head_dim): added to the values


@dataclass(frozen=True, slots=True)
class MLPWeights(Generic[A]):
    c_fc: LinearWeights[A]  # the up-projection
    c_proj: LinearWeights[A]  # the down-projection
    c_gate: LinearWeights[A] | None  # SwiGLU's gate: silu(gate x) * (c_fc x)
    activation: str  # "gelu", "relu2" or "swiglu"
    # SwiGLU with one input product: c_fc's outputs are the gate's, then the up-projection's (c_gate None)
    fused_gate: bool = False


@dataclass(frozen=True, slots=True)
class BlockWeights(Generic[A]):
    ln_1: NormWeights[A]
    attn: AttentionWeights[A]
    ln_2: NormWeights[A]
    mlp: MLPWeights[A]


@dataclass(frozen=True, slots=True)
class ModelWeights(Generic[A]):
    wte: A
    wpe: A | None  # None with rotary positions
    h: tuple[BlockWeights[A], ...]
    ln_f: NormWeights[A]
    lm_head: A  # wte itself when the embeddings are tied
    rope_base: float | None  # rotary positions' base, None with learned positions
    head_dim: int
    skips: A | None = None  # U-net skips' weights (n_layer // 2,), pair i as GPTConfig.skip_pairs lists it
    skip_pairs: tuple[tuple[int, int], ...] = ()
    logit_cap: float | None = None  # soft cap of the logits: cap * tanh(logits / cap)


def weights_by_name(
    config: GPTConfig, tensors: Mapping[str, A], lora_scale: float | None = None
) -> ModelWeights[A]:
    """The tree of `tensors` named as GPT-2 names them; absent biases are None, an absent head is wte.
    With `lora_scale`, a layer's `lora_A` and `lora_B` beside its weight become its LowRank update."""
    rms = config.norm == "rmsnorm"

    def linear(name: str) -> LinearWeights[A]:
        low_rank = None
        if lora_scale is not None and f"{name}.lora_A" in tensors:
            low_rank = LowRank(tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], lora_scale)
        return LinearWeights(tensors[f"{name}.weight"], tensors.get(f"{name}.bias"), lora=low_rank)

    def norm(name: str, is_rms: bool = rms) -> NormWeights[A]:
        return NormWeights(
            tensors[f"{name}.weight"], tensors.get(f"{name}.bias"), config.layer_norm_eps, is_rms
        )

    def block(p: str, window: int) -> BlockWeights[A]:
        qk = config.qk_norm
        attn = AttentionWeights(
            linear(f"{p}.attn.c_attn"),
            linear(f"{p}.attn.c_proj"),
            config.n_head,
            config.kv_heads,
            window,
            norm(f"{p}.attn.q_norm", True) if qk else None,
            norm(f"{p}.attn.k_norm", True) if qk else None,
            config.attn_score,
            tuple(tensors[f"{p}.{name}"] for name in score_shapes(config)),
            tensors[f"{p}.attn.v_embed.weight"] if config.value_embeds else None,
        )
        gate = linear(f"{p}.mlp.c_gate") if config.mlp == "swiglu" else None
        mlp = MLPWeights(linear(f"{p}.mlp.c_fc"), linear(f"{p}.mlp.c_proj"), gate, config.mlp)
        return BlockWeights(norm(f"{p}.ln_1"), attn, norm(f"{p}.ln_2"), mlp)

    wte = tensors["transformer.wte.weight"]
    return ModelWeights(
        wte=wte,
        wpe=tensors["transformer.wpe.weight"] if config.pos == "learned" else None,
        h=tuple(block(f"transformer.h.{i}", w) for i, w in enumerate(config.layer_windows)),
        ln_f=norm("transformer.ln_f"),
        lm_head=tensors.get("lm_head.weight", wte),
        rope_base=config.rope_base if config.pos == "rope" else None,
        head_dim=config.head_dim,
        skips=tensors["skip_weights"] if config.skips else None,
        skip_pairs=config.skip_pairs,
        logit_cap=config.logit_cap,
    )


def is_adapter_tensor(name: str) -> bool:
    """A LoRA adapter's tensor (minigpt.model.lora): a layer's lora_A or lora_B, or new embedding or head rows."""
    return name.endswith((".lora_A", ".lora_B", ".added"))


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """A 2-D weight inside a transformer block (attention and MLP projections): what Muon trains.
    Embeddings (value embeddings too), the LM head and every 1-D gain or bias stay with AdamW, as Muon's
    authors advise, and so do LoRA's low-rank factors (orthogonalising a rank-r factor is not the update
    LoRA is tuned for)."""
    if name.endswith("v_embed.weight") or is_adapter_tensor(name):
        return False
    return ndim == 2 and name.startswith("transformer.h.")


def map_linears(node: Any, fn: Callable[[LinearWeights[Any]], LinearWeights[Any]]) -> Any:
    """A copy of a weight tree (or any part of it) with `fn` applied to every linear layer."""
    if isinstance(node, LinearWeights):
        return fn(node)
    if isinstance(node, tuple):
        return tuple(map_linears(n, fn) for n in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: map_linears(getattr(node, f.name), fn) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    return node


def fuse_gate_up(w: MLPWeights[A], cat: Callable[[Sequence[A]], A]) -> MLPWeights[A]:
    """SwiGLU's gate and up-projection as one linear layer (`cat` stacks arrays along their first
    axis): one matrix product reads both, and the activation splits its outputs in two."""
    if w.c_gate is None or w.fused_gate:
        return w
    bias = None if w.c_fc.bias is None or w.c_gate.bias is None else cat([w.c_gate.bias, w.c_fc.bias])
    fused = LinearWeights(cat([w.c_gate.weight, w.c_fc.weight]), bias)
    return dataclasses.replace(w, c_fc=fused, c_gate=None, fused_gate=True)


def for_decoding(
    w: ModelWeights[A], cat: Callable[[Sequence[A]], A], transpose: Callable[[A], A] | None = None
) -> ModelWeights[A]:
    """The tree as a decoding engine holds it: SwiGLU's two input projections fused, and with `transpose`
    (a contiguous transposed copy) every linear weight input-major. The file's tensors are untouched."""
    blocks = tuple(dataclasses.replace(b, mlp=fuse_gate_up(b.mlp, cat)) for b in w.h)
    w = dataclasses.replace(w, h=blocks)
    if transpose is None:
        return w

    def input_major(lin: LinearWeights[A]) -> LinearWeights[A]:
        if lin.input_major or lin.scale is not None:
            return lin
        return dataclasses.replace(lin, weight=transpose(lin.weight), input_major=True)

    return map_linears(w, input_major)


def block_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name (within a block) and shape of every tensor of one transformer block: the one statement of the
    block's layout, which the model builds its layers from and a weights file is checked against."""
    C, F, hd = config.n_embd, config.d_ff, config.head_dim
    linears = {
        "attn.c_attn": ((config.n_head + 2 * config.kv_heads) * hd, C),  # queries, then keys and values
        "attn.c_proj": (C, C),
        "mlp.c_fc": (F, C),
        "mlp.c_proj": (C, F),
    }
    if config.mlp == "swiglu":
        linears["mlp.c_gate"] = (F, C)
    tables = {"attn.v_embed.weight": (config.vocab_size, config.kv_heads * hd)} if config.value_embeds else {}
    norms = {"ln_1": C, "ln_2": C, **({"attn.q_norm": hd, "attn.k_norm": hd} if config.qk_norm else {})}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, width in norms.items():
        shapes[f"{name}.weight"] = (width,)
        if norm_has_bias(config, name):
            shapes[f"{name}.bias"] = (width,)
    for name, shape in linears.items():
        shapes[f"{name}.weight"] = shape
        if config.bias:
            shapes[f"{name}.bias"] = shape[:1]
    return {**shapes, **tables, **score_shapes(config)}


def score_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The attention score's per-head maps within a block, each (n_head, out, in) in torch's Linear layout:
    general's W on the queries, (Wq)·k; additive's W₁ on the queries, W₂ on the keys and vᵀ,
    vᵀtanh(W₁q + W₂k). scaled and dot have none."""
    H, hd, da = config.n_head, config.head_dim, config.additive_width
    if config.attn_score == "general":
        return {"attn.score.weight": (H, hd, hd)}
    if config.attn_score == "additive":
        return {
            "attn.score_q.weight": (H, da, hd),
            "attn.score_k.weight": (H, da, hd),
            "attn.score_v.weight": (H, 1, da),
        }
    return {}


def norm_has_bias(config: GPTConfig, name: str) -> bool:
    """LayerNorms carry a bias when the model has biases; RMSNorms (QK-norm's too) never do."""
    return config.bias and config.norm == "layernorm" and not name.endswith(("q_norm", "k_norm"))


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor a run's weights file holds for `config` (the tied head left out),
    worked out without torch; the model is built from the same statement (`block_shapes`)."""
    C, V = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (V, C)}
    if config.pos == "learned":
        shapes["transformer.wpe.weight"] = (config.block_size, C)
    block = block_shapes(config)
    for i in range(config.n_layer):
        shapes.update({f"transformer.h.{i}.{name}": shape for name, shape in block.items()})
    shapes["transformer.ln_f.weight"] = (C,)
    if norm_has_bias(config, "ln_f"):
        shapes["transformer.ln_f.bias"] = (C,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    if config.skips:
        shapes["skip_weights"] = (len(config.skip_pairs),)
    return shapes


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"


def check_shapes(config: GPTConfig, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    """Stored tensor names and shapes must be exactly what the config describes (a one-line error)."""
    layers = len({name.split(".")[2] for name in shapes if name.startswith("transformer.h.")})
    if layers != config.n_layer:  # first: a config may claim a billion layers, too many to list
        raise MinigptError(
            f"{source} does not match its config.json (it holds {layers:,} layers, config says "
            f"{config.n_layer:,})"
        )
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [k for k in expected if k in shapes and tuple(shapes[k]) != expected[k]]  # in model order
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected {_listed(unexpected)}")
        if wrong:
            k = wrong[0]
            parts.append(f"{k} has shape {list(shapes[k])}, config says {list(expected[k])}")
        raise MinigptError(f"{source} does not match its config.json ({'; '.join(parts)})")
