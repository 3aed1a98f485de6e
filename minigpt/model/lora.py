"""Low-rank adapters (LoRA): which matrices they adapt, their tensors, the adapter file, and merging.

A LoRA run trains, for each chosen linear layer of every block, two small matrices A (rank x in) and
B (out x rank) while the base weights stay frozen; the layer computes x W^T + b + (alpha / rank) (x A^T) B^T
(`adapters.low_rank`, over the weight tree's `LowRank`). B starts at zero, so training starts from the base
model exactly. Tokens the fine-tuning adds (the chat template's) get new embedding and head rows, trained in
full as part of the adapter: `<layer>.added`. Beside the factors a run may train tensors whole: the embedding,
the head, every norm's gain, the linear layers' biases.

The adapter file holds only these tensors, with the sha256 of the base run's weights file in its header: it
is applied to that base and refused on any other. Merging adds (alpha / rank) B A to each adapted weight and
appends the new rows, giving a plain model; this module does it for torch tensors and NumPy arrays alike
(importable without torch), which is how every command runs an adapted run.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from minigpt.common.files import regular_file
from minigpt.common.strict_json import JsonError, parse_json
from minigpt.errors import MinigptError, UsageError
from minigpt.model.config import GPTConfig
from minigpt.model.weights import expected_shapes

A = TypeVar("A")  # torch.Tensor or np.ndarray

ADAPTER_FORMAT = "minigpt-adapter"
# the linear layers of a block by the name the params table gives them, and groups of them
LAYERS = {
    "qkv": "attn.c_attn",
    "out": "attn.c_proj",
    "up": "mlp.c_fc",
    "gate": "mlp.c_gate",
    "down": "mlp.c_proj",
}
GROUPS = {"attn": ("qkv", "out"), "mlp": ("up", "gate", "down"), "all": tuple(LAYERS)}
ADDED = "added"  # the suffix of new embedding and head rows: transformer.wte.added, lm_head.added
EMBEDDING = "transformer.wte"
HEAD = "lm_head"
# matrices a LoRA run may train whole beside its adapters (PEFT's "modules to save"), saved in the adapter
# file: they map tokens to the hidden space and back, which a low-rank update of the blocks reaches only
# through its rank (upper-casing is a mapping of 26 letters to 26 others); small where the vocabulary is
WHOLE = {"embedding": f"{EMBEDDING}.weight", "head": f"{HEAD}.weight"}
# vectors a LoRA run may train whole: every normalisation's gain (and a LayerNorm's bias), and the linear
# layers' biases (PEFT's bias="all"); a few thousand numbers. Not in the default: freezing the norms cost full
# fine-tuning most of its accuracy, but training them gave LoRA nothing
VECTORS = {
    "norms": re.compile(r"transformer\.(h\.\d+\.(ln_1|ln_2|attn\.q_norm|attn\.k_norm)|ln_f)\.(weight|bias)"),
    "biases": re.compile(rf"transformer\.h\.\d+\.({'|'.join(re.escape(v) for v in LAYERS.values())})\.bias"),
}
TARGET_CHOICES = ", ".join([*LAYERS, *GROUPS, *WHOLE, *VECTORS])
DEFAULT_TARGETS = "all"


def resolve_targets(spec: str | Sequence[str], config: GPTConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What comma-separated `spec` picks: the block-relative layers to adapt ("attn.c_attn", ...), in block
    order, a SwiGLU gate only where the model has one; and the tensors to train whole, in the weights
    file's order (WHOLE's matrices, a tied head being the embedding, and VECTORS' vectors)."""
    words = [w.strip() for w in (spec.split(",") if isinstance(spec, str) else spec) if w.strip()]
    if not words:
        raise UsageError(f"--lora-targets is empty: choose from {TARGET_CHOICES}")
    picked: set[str] = set()
    for word in words:
        if word not in LAYERS and word not in GROUPS and word not in WHOLE and word not in VECTORS:
            raise UsageError(f"unknown --lora-targets {word!r}: choose from {TARGET_CHOICES}")
        if word == "gate" and config.mlp != "swiglu":
            raise UsageError(f"--lora-targets gate: this model's MLP ({config.mlp}) has no gate matrix")
        if word == "biases" and not config.bias:
            raise UsageError("--lora-targets biases: this model's linear layers have no biases")
        picked.update(GROUPS.get(word, (word,)))
    if config.mlp != "swiglu":
        picked.discard("gate")
    whole = {WHOLE["embedding" if config.tie_embeddings else k] for k in WHOLE if k in picked}
    names = expected_shapes(config)
    whole |= {n for kind in VECTORS if kind in picked for n in names if VECTORS[kind].fullmatch(n)}
    return tuple(LAYERS[k] for k in LAYERS if k in picked), tuple(n for n in names if n in whole)


def is_whole_name(name: str) -> bool:
    """Whether `name` is a tensor a LoRA run may train whole (WHOLE's or VECTORS')."""
    return name in WHOLE.values() or any(p.fullmatch(name) for p in VECTORS.values())


def whole_words(names: Sequence[str]) -> list[str]:
    """The --lora-targets words that train `names` whole, for a one-line summary."""
    words = [w for w, n in WHOLE.items() if n in names]
    return words + [w for w, p in VECTORS.items() if any(p.fullmatch(n) for n in names)]


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter's shape: rank, alpha (the update is scaled by alpha / rank), the adapted layers of
    every block, how many new token rows it adds to the embedding (and an untied head), and the matrices
    it trains whole (by name: WHOLE's matrices and VECTORS' vectors)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    new_rows: int = 0
    whole: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.whole, list | tuple) or not all(
            isinstance(w, str) and is_whole_name(w) for w in self.whole
        ):
            raise MinigptError(
                f"LoRA's whole tensors must be the embedding, the head, norms or biases, got {self.whole!r}"
            )
        object.__setattr__(self, "whole", tuple(self.whole))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= 4096:
            raise UsageError(f"--lora-rank must be an integer from 1 to 4096, got {self.rank!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, int | float)
            or not 0 < self.alpha < 1e6
        ):
            raise UsageError(f"--lora-alpha must be a positive number, got {self.alpha!r}")
        known = set(LAYERS.values())
        if not (self.targets or self.whole) or any(t not in known for t in self.targets):
            raise MinigptError(f"LoRA targets must be some of {', '.join(known)}, got {list(self.targets)}")
        if (
            isinstance(self.new_rows, bool)
            or not isinstance(self.new_rows, int)
            or not 0 <= self.new_rows <= 4096
        ):
            raise MinigptError(f"LoRA new_rows must be 0 to 4096, got {self.new_rows!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets), "whole": list(self.whole)}

    @classmethod
    def from_json(cls, data: Any, source: str | Path) -> LoRAConfig:
        if not isinstance(data, dict):
            raise MinigptError(f"{source}: the LoRA settings are missing or damaged")
        try:
            return cls(**data)
        except (TypeError, MinigptError) as e:
            raise MinigptError(f"{source}: damaged LoRA settings ({e})") from None


def base_config(config: GPTConfig, lora: LoRAConfig) -> GPTConfig:
    """The base model's shape: the adapted one without the rows the adapter adds."""
    if config.vocab_size <= lora.new_rows:
        raise MinigptError(f"the adapter adds {lora.new_rows} rows to a vocabulary of {config.vocab_size}")
    return replace(config, vocab_size=config.vocab_size - lora.new_rows)


def adapter_shapes(config: GPTConfig, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every adapter tensor for the adapted model `config` (worked out without torch)."""
    base = expected_shapes(base_config(config, lora))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.n_layer):
        for target in lora.targets:
            out, inp = base[f"transformer.h.{i}.{target}.weight"]
            shapes[f"transformer.h.{i}.{target}.lora_A"] = (lora.rank, inp)
            shapes[f"transformer.h.{i}.{target}.lora_B"] = (out, lora.rank)
    for name in lora.whole:
        if name not in base:
            raise MinigptError(f"the adapter trains {name} whole, which this model does not have")
        shapes[name] = base[name]
    if lora.new_rows:
        shapes[f"{EMBEDDING}.{ADDED}"] = (lora.new_rows, config.n_embd)
        if not config.tie_embeddings:
            shapes[f"{HEAD}.{ADDED}"] = (lora.new_rows, config.n_embd)
    return shapes


def trainable_count(config: GPTConfig, lora: LoRAConfig) -> int:
    """Parameters a LoRA run trains."""
    total = 0
    for shape in adapter_shapes(config, lora).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def join_added_rows(tensors: Mapping[str, A], cat: Callable[[list[A]], A]) -> dict[str, A]:
    """`tensors` with each `<layer>.added` appended to `<layer>.weight` (and dropped): the embedding and
    head of the adapted vocabulary. `cat` joins along the rows (torch.cat or np.concatenate)."""
    out = {k: v for k, v in tensors.items() if not k.endswith(f".{ADDED}")}
    for layer in (EMBEDDING, HEAD):
        added = tensors.get(f"{layer}.{ADDED}")
        if added is not None and f"{layer}.weight" in tensors:
            out[f"{layer}.weight"] = cat([tensors[f"{layer}.weight"], added])
    return out


def merge(
    base: Mapping[str, A], adapter: Mapping[str, A], lora: LoRAConfig, cat: Callable[[list[A]], A]
) -> dict[str, A]:
    """The adapted model's plain weights: W + (alpha / rank) B A for each adapted layer, the tensors trained
    whole in place of the base's, new rows appended."""
    merged = {**base, **{name: adapter[name] for name in lora.whole}}
    suffix = ".lora_A"
    for name in (k for k in adapter if k.endswith(suffix)):
        layer = name[: -len(suffix)]
        merged[f"{layer}.weight"] = (
            base[f"{layer}.weight"] + (adapter[f"{layer}.lora_B"] @ adapter[name]) * lora.scale
        )  # type: ignore[operator]
    added = {k: v for k, v in adapter.items() if k.endswith(f".{ADDED}")}
    return join_added_rows({**merged, **added}, cat)


def check_adapter_shapes(
    config: GPTConfig, lora: LoRAConfig, shapes: Mapping[str, tuple[int, ...]], source: Path
) -> None:
    """The adapter file's tensor names and shapes must be exactly what its settings imply."""
    expected = adapter_shapes(config, lora)
    wrong = sorted(set(expected) ^ set(shapes)) or sorted(
        k for k in expected if tuple(shapes[k]) != expected[k]
    )
    if wrong:
        raise MinigptError(
            f"{source} does not hold the adapter its settings describe (rank {lora.rank}, "
            f"{len(lora.targets)} target layer(s)): {wrong[0]} is missing, unexpected or misshapen"
        )


def adapter_metadata(lora: LoRAConfig, base_sha256: str, step: int) -> dict[str, str]:
    """What an adapter file's header carries: its settings and the weights it applies to."""
    return {
        "format": ADAPTER_FORMAT,
        "lora": json.dumps(lora.to_json()),
        "base_sha256": base_sha256,
        "step": str(step),
    }


def read_adapter_metadata(meta: Mapping[str, str], source: Path) -> tuple[LoRAConfig, str]:
    """The settings and base hash of an adapter file's header, checked."""
    if meta.get("format") != ADAPTER_FORMAT:
        raise MinigptError(f"{source} is not a minigpt adapter (no format '{ADAPTER_FORMAT}' in its header)")
    try:
        settings = parse_json(meta.get("lora", ""))
    except JsonError as e:
        raise MinigptError(
            f"{source}: the LoRA settings in its header are damaged ({e}); restore the run or train it again"
        ) from None
    sha = meta.get("base_sha256", "")
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise MinigptError(f"{source}: the base weights' sha256 in its header is damaged")
    return LoRAConfig.from_json(settings, source), sha


def file_sha256(path: Path) -> str:
    """sha256 of a regular file, read in blocks."""
    h = hashlib.sha256()
    try:
        with open(regular_file(path), "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    except OSError as e:
        raise MinigptError(f"cannot read {path} ({e.strerror})") from None
    return h.hexdigest()


def check_base(actual_sha256: str, expected_sha256: str, base: Path, adapter: Path) -> None:
    """Refuse to apply an adapter to weights other than the ones it was trained on."""
    if actual_sha256 != expected_sha256:
        raise MinigptError(
            f"{adapter} was trained on other base weights (sha256 {expected_sha256[:12]}...) than {base} holds "
            f"({actual_sha256[:12]}...): adapters only apply to their own base; restore that base run "
            f"or give it with --base"
        )
