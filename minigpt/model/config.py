"""GPTConfig: every shape of the model, validated on construction (importable without torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from minigpt.common.settings import ARCH, MODEL, check_choices, setting
from minigpt.common.strict_json import preview
from minigpt.errors import UsageError

MAX_WINDOW_PATTERN = 4096  # letters of window_pattern: one per layer at most, over the deepest models
HINT_SPAN = (
    4096  # head counts a width hint searches on either side of the one given (any width may be claimed)
)

POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu2", "swiglu")
SCORES = ("scaled", "dot", "general", "additive")  # how a query scores a key (--attn-score)
# Architectures: GPT-2's (the one that maps to Hugging Face GPT-2) and the later choices small-model
# recipes converged on, which an ablation of the CPU recipe picked (bench/bench_recipe.py); each field given
# on its own overrides the one it names.
ARCHS: dict[str, dict[str, Any]] = {
    "gpt2": dict(pos="learned", norm="layernorm", mlp="gelu", qk_norm=False, tie_embeddings=True, bias=True),
    "modern": dict(pos="rope", norm="rmsnorm", mlp="swiglu", qk_norm=False, tie_embeddings=False, bias=True),
}
PRESET_DEFAULT = "the preset's"  # how help states the default of a shape a preset fixes


@dataclass(frozen=True)
class GPTConfig:
    """Every shape of the model; the single source of truth, validated on construction."""

    vocab_size: int = setting(50257, "Vocabulary size.", panel=MODEL)
    block_size: int = setting(1024, "Context length in tokens.", panel=MODEL, shown=PRESET_DEFAULT)
    n_layer: int = setting(12, "Transformer blocks.", panel=MODEL, shown=PRESET_DEFAULT)
    n_head: int = setting(12, "Attention heads per block.", panel=MODEL, shown=PRESET_DEFAULT)
    n_embd: int = setting(768, "Model width (divisible by --n-head).", panel=MODEL, shown=PRESET_DEFAULT)
    dropout: float = setting(0.0, "Dropout probability in [0, 1).", panel=MODEL)
    # the architecture: GPT-2's choices by default; the others are what later small models adopted
    bias: bool = setting(
        True, "Biases in Linear and LayerNorm layers (off with --qk-norm unless given).", panel=ARCH, by=ARCHS
    )
    tie_embeddings: bool = setting(
        True, "Share the token embedding with the LM head.", panel=ARCH, by=ARCHS,
        flags=("--tie/--untie", "--tied/--untied"),
    )  # fmt: skip
    layer_norm_eps: float = 1e-5  # the eps of every norm, LayerNorm or RMSNorm
    pos: str = setting(
        "learned", "Positions: learned (wpe) or rope (rotary).", panel=ARCH, choices=POSITIONS, by=ARCHS
    )
    rope_base: float = setting(10000.0, "Base of the rotary frequencies.", panel=ARCH)
    norm: str = setting("layernorm", "layernorm or rmsnorm.", panel=ARCH, choices=NORMS, by=ARCHS)
    mlp: str = setting(  # gelu is GPT-2's tanh form; swiglu adds a gate matrix
        "gelu", "MLP activation: gelu, relu2 (ReLU²) or swiglu.", panel=ARCH, choices=MLPS, by=ARCHS
    )
    mlp_width: int | None = None  # None: 4 n_embd, or for swiglu 8/3 n_embd rounded up to 64 (same size)
    qk_norm: bool = setting(False, "RMSNorm of each head's queries and keys.", panel=ARCH, by=ARCHS)
    n_kv_head: int | None = setting(  # fewer than n_head is grouped-query attention
        None, "Key/value heads (grouped-query attention; 1 is multi-query).", panel=ARCH, shown="n_head"
    )
    window: int | None = setting(  # an S layer's window, itself included
        None, "Tokens a local (S) layer attends to.", panel=ARCH, shown="none, every layer full"
    )
    window_pattern: str = setting(
        "S", "S (local) and L (full) per layer, repeated; the last layer is L.", panel=ARCH
    )
    attn_score: str = setting(
        "scaled",
        "How a query q scores a key k. scaled: q·k/√d_head (Vaswani et al. 2017), through the fused "
        "attention kernel. dot: q·k (Luong et al. 2015), the same kernel and cost, its logits growing with "
        "d_head. general: (Wq)·k (Luong et al. 2015), a d_head x d_head matrix W per head and layer "
        "applied to the queries, then the fused kernel; in self-attention W folds into the query "
        "projection, so it adds parameters and changes the optimisation, not what the model can compute. "
        "additive: vᵀtanh(W₁q + W₂k) (Bahdanau et al. 2014), width d_a = d_head (2·d_head² + d_head "
        "parameters per head and layer); no fused kernel: d_head values per query-key pair, computed a "
        "bounded chunk of queries at a time (and again in the backward pass), several times slower.",
        panel=ARCH,
        choices=SCORES,
    )
    # later speedrun choices (modded-nanogpt): none maps to a Hugging Face model
    value_embeds: bool = setting(
        False, "Value embeddings: each layer adds a learned embedding of the token to its attention values.",
        panel=ARCH,
    )  # fmt: skip
    skips: bool = setting(
        False, "U-net skips: the last n_layer/2 layers each add, times a learned weight, the input of the "
        "layer mirroring them (the last layer the embeddings).", panel=ARCH,
    )  # fmt: skip
    logit_cap: float | None = setting(
        None, "Soft-cap the logits at this size: cap * tanh(logits / cap).", panel=ARCH, shown="none"
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _check_count(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise UsageError(_width_hint(self.n_embd, self.n_head))
        if isinstance(self.dropout, bool) or not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("bias", "tie_embeddings", "qk_norm", "value_embeds", "skips"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be true or false, got {preview(getattr(self, name))}")
        for name in ("layer_norm_eps", "rope_base", "logit_cap"):
            value = getattr(self, name)
            if value is None and name == "logit_cap":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise UsageError(f"{name} must be a positive number, got {preview(value)}")
        if self.skips and self.n_layer < 2:
            raise UsageError("skips join a layer to its mirror: they need n_layer 2 or more (drop --skips)")
        check_choices(self)
        self._check_attention()
        if self.mlp_width is not None:
            _check_count("mlp_width", self.mlp_width)

    def _check_attention(self) -> None:
        if self.n_kv_head is not None:
            _check_count("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise UsageError(
                    f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}): each key/value head "
                    "serves an equal group of query heads"
                )
        if self.pos == "rope" and self.head_dim % 2:
            raise UsageError(f"rotary positions need an even head size, got {self.head_dim}")
        if self.window is not None:
            _check_count("window", self.window)
            if self.window > self.block_size:
                raise UsageError(
                    f"window ({self.window}) must be at most block_size ({self.block_size}); "
                    "leave it out for full attention"
                )
        pattern = self.window_pattern
        if (
            not isinstance(pattern, str)
            or not pattern
            or set(pattern) - {"S", "L"}
            or len(pattern) > MAX_WINDOW_PATTERN
        ):
            raise UsageError(
                f"window_pattern must be letters S (local) and L (full), at most {MAX_WINDOW_PATTERN:,} of "
                f"them, for example SSSL; got {preview(pattern)}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def additive_width(self) -> int:
        """d_a, the width of the additive score's hidden layer: d_head, as Bahdanau et al. size theirs (the
        width of the states scored). It makes a query-key pair cost d_head multiply-adds, as a dot product
        does, and its memory (B·H·T·T·d_a values) d_head times the logits'; a wider layer would buy
        function (the score is a one-hidden-layer MLP of q and k) with memory and time linearly."""
        return self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is not set."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def d_ff(self) -> int:
        """Width of the MLP's hidden layer: 4 x n_embd as in GPT-2 and GPT-3; SwiGLU's three matrices
        take 8/3 x n_embd (rounded up to a multiple of 64) to hold as many parameters as two of 4 x."""
        if self.mlp_width is not None:
            return self.mlp_width
        if self.mlp == "swiglu":
            return -(-8 * self.n_embd // (3 * 64)) * 64
        return 4 * self.n_embd

    @property
    def skip_pairs(self) -> tuple[tuple[int, int], ...]:
        """(giving layer, taking layer) of each U-net skip: layer L-1-i takes the input of layer i, for
        i < L/2 (layer 0's input is the embeddings); the pair's index is its weight's."""
        if not self.skips:
            return ()
        return tuple((i, self.n_layer - 1 - i) for i in range(self.n_layer // 2))

    @property
    def cached_positions(self) -> int:
        """Positions a full KV cache keeps over all layers: sum(layer_windows)."""
        return self.kept_positions()

    def kept_positions(self, capacity: int | None = None) -> int:
        """Positions a KV cache keeps over all layers when each holds at most `capacity` (None: its window,
        as a cache for a whole block), worked out without listing the layers (a config.json may claim
        10**9 of them)."""
        full = self.block_size if capacity is None else min(self.block_size, capacity)
        if self.window is None:
            return self.n_layer * full
        p, before_last = self.window_pattern, self.n_layer - 1
        local = before_last // len(p) * p.count("S") + p[: before_last % len(p)].count("S")
        window = self.window if capacity is None else min(self.window, capacity)
        return local * window + (self.n_layer - local) * full

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """How many of the latest positions each layer attends to: `window` for S layers, block_size
        for L layers (a rotary model decoding past block_size keeps that many; learned positions never
        go past it)."""
        p = self.window_pattern
        local = [self.window is not None and p[i % len(p)] == "S" for i in range(self.n_layer)]
        local[-1] = False
        return tuple(self.window if is_local and self.window else self.block_size for is_local in local)

    @property
    def architecture(self) -> str:
        """The choices that differ from GPT-2's, in words ("gpt2" when none do)."""
        parts = [] if self.pos == "learned" else [self.pos]
        parts += [v for v, gpt2 in ((self.norm, "layernorm"), (self.mlp, "gelu")) if v != gpt2]
        if self.qk_norm:
            parts.append("qk-norm")
        if self.attn_score != "scaled":
            parts.append(f"{self.attn_score} attention scores")
        if self.kv_heads != self.n_head:
            parts.append(f"{self.kv_heads} kv heads")
        if self.window is not None and self.window < self.block_size and self.n_layer > 1:
            parts.append(f"window {self.window} ({self.window_pattern})")
        parts += [name for name, on in (("value embeds", self.value_embeds), ("skips", self.skips)) if on]
        if self.logit_cap is not None:
            parts.append(f"logit cap {self.logit_cap:g}")
        if not self.tie_embeddings:
            parts.append("untied")
        if not self.bias:
            parts.append("no bias")
        return ", ".join(parts) or "gpt2"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown model config keys {unknown}: is this a minigpt config?")
        return cls(**data)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {preview(value)}")


def _width_hint(n_embd: int, n_head: int) -> str:
    """Why n_embd must divide by n_head, and the nearest shapes that work: other head counts for this width,
    or widths whose head size is a multiple of 8 (what fast attention kernels want) for this head count."""
    # the nearest head counts within HINT_SPAN of n_head: a config.json may claim a width of 10**12
    below = [h for h in range(min(n_head - 1, n_embd), max(n_head - HINT_SPAN, 0), -1) if n_embd % h == 0][:1]
    above = [h for h in range(n_head + 1, min(n_embd, n_head + HINT_SPAN) + 1) if n_embd % h == 0][:1]
    step = 8 * n_head
    widths = [w for w in (n_embd // step * step, (n_embd // step + 1) * step) if w > 0]
    heads = f"n_head {' or '.join(map(str, below + above))}, or " if below + above else ""
    return (
        f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): each head gets an equal share of the "
        f"width; try {heads}n_embd {' or '.join(map(str, widths))} "
        f"(head size {' or '.join(str(w // n_head) for w in widths)}: multiples of 8 suit attention kernels)"
    )
