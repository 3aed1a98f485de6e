"""GPTConfig: every shape of the model, validated on construction (importable without torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from minigpt.errors import UsageError


@dataclass(frozen=True)
class GPTConfig:
    """Every shape of the model; the single source of truth, validated on construction."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise UsageError(_width_hint(self.n_embd, self.n_head))
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.layer_norm_eps > 0:
            raise UsageError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def d_ff(self) -> int:
        """Width of the MLP's hidden layer (4 x n_embd, as in GPT-2 and GPT-3)."""
        return 4 * self.n_embd

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown model config keys {unknown}: is this a minigpt config?")
        return cls(**data)


def _width_hint(n_embd: int, n_head: int) -> str:
    """Why n_embd must divide by n_head, and the nearest shapes that work: other head counts for this width,
    or widths whose head size is a multiple of 8 (what fast attention kernels want) for this head count."""
    below = [h for h in range(1, min(n_head, n_embd + 1)) if n_embd % h == 0][-1:]
    above = [h for h in range(n_head + 1, n_embd + 1) if n_embd % h == 0][:1]
    step = 8 * n_head
    widths = [w for w in (n_embd // step * step, (n_embd // step + 1) * step) if w > 0]
    return (
        f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): each head gets an equal share of the "
        f"width; try n_head {' or '.join(map(str, below + above))}, or n_embd {' or '.join(map(str, widths))} "
        f"(head size {' or '.join(str(w // n_head) for w in widths)}: multiples of 8 suit attention kernels)"
    )
