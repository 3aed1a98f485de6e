"""Analytic parameter, memory and FLOP accounting for a GPTConfig (GPT-3 style breakdown)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minigpt.config import GPTConfig


@dataclass(frozen=True)
class Row:
    """One line of a breakdown: what it counts, the arithmetic written out, and the result."""

    name: str
    formula: str
    count: int


@dataclass(frozen=True)
class ParamReport:
    """The GPT-3 style breakdown, its reconciliation with the real module, and derived costs."""

    config: GPTConfig
    rows: list[Row]
    gpt3_total: int
    adjustments: list[Row]
    exact_total: int
    shares: dict[str, int]
    memory_bytes: dict[str, int]
    flops_per_token: dict[str, int]
    kv_cache_bytes: dict[str, int]
    formulas: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "breakdown": [{"name": r.name, "formula": r.formula, "count": r.count} for r in self.rows],
            "gpt3_total": self.gpt3_total,
            "adjustments": [
                {"name": r.name, "formula": r.formula, "count": r.count} for r in self.adjustments
            ],
            "exact_total": self.exact_total,
            "shares": self.shares,
            "memory_bytes": self.memory_bytes,
            "flops_per_token": self.flops_per_token,
            "kv_cache_bytes": self.kv_cache_bytes,
            "formulas": self.formulas,
        }


def _n(x: int) -> str:
    return f"{x:,}"


def _gpt3_rows(config: GPTConfig) -> list[Row]:
    """The eight parts of the GPT-3 style table (Kaplan et al.'s accounting of a transformer)."""
    V, L, H, D, hd, F = (
        config.vocab_size,
        config.n_layer,
        config.n_head,
        config.n_embd,
        config.head_dim,
        config.d_ff,
    )
    layers = f"{_n(L)} layers"
    head_rows = f"{_n(hd)} × {_n(D)} × {_n(H)} heads × {layers}"
    return [
        Row("Embedding", f"{_n(V)} × {_n(D)}", V * D),
        Row("Key", head_rows, D * hd * H * L),
        Row("Query", head_rows, D * hd * H * L),
        Row("Value", head_rows, D * hd * H * L),
        Row("Output", f"{_n(hd)} × {_n(H)} heads × {_n(D)} × {layers}", hd * H * D * L),
        Row("Up-projection", f"{_n(D)} × {_n(F)} × {layers}", D * F * L),
        Row("Down-projection", f"{_n(F)} × {_n(D)} × {layers}", F * D * L),
        Row("Unembedding", f"{_n(D)} × {_n(V)}", D * V),
    ]


def _adjustments(config: GPTConfig) -> list[Row]:
    """What the module holds beyond the GPT-3 table: positions, biases, norms, less a tied head."""
    V, T, L, D, F = config.vocab_size, config.block_size, config.n_layer, config.n_embd, config.d_ff
    layers = f"{_n(L)} layers"
    rows = [Row("Position embeddings", f"{_n(T)} × {_n(D)}", T * D)]
    if config.bias:  # c_attn 3D + attn c_proj D + c_fc 4D + mlp c_proj D per layer
        biases = f"(3 × {_n(D)} + {_n(D)} + {_n(F)} + {_n(D)}) × {layers}"
        rows.append(Row("Linear biases", biases, (4 * D + F + D) * L))
    norm_kind, norm_width = ("gain + bias", 2 * D) if config.bias else ("gain", D)
    rows.append(Row("LayerNorms", f"(2 × {layers} + 1) × {_n(D)} ({norm_kind})", (2 * L + 1) * norm_width))
    if config.tie_embeddings:
        rows.append(Row("Tied unembedding (shares wte)", f"−{_n(D)} × {_n(V)}", -D * V))
    return rows


def _shares(config: GPTConfig) -> dict[str, int]:
    V, T, L, D, F = config.vocab_size, config.block_size, config.n_layer, config.n_embd, config.d_ff
    bias = config.bias
    return {
        "attention": 4 * D * D * L + (4 * D * L if bias else 0),
        "mlp": 2 * D * F * L + ((F + D) * L if bias else 0),
        "embeddings": V * D + T * D + (0 if config.tie_embeddings else D * V),
        "layernorm": (2 * L + 1) * (2 * D if bias else D),
    }


FORMULAS = {
    "memory": "weights: 4 B (fp32) or 2 B (bf16) per parameter; training with AdamW: 16 B per "
    "parameter (fp32 weights, gradients and two moments), activations not included",
    "flops": "forward = 2·N + 4·n_layer·n_embd·block_size, training = 3 × forward (PaLM, "
    "appendix B), N = parameters less position embeddings",
    "kv_cache": "2 (key, value) × n_layer × n_embd × bytes per element, per token",
}


def count_params(config: GPTConfig) -> ParamReport:
    """Count every parameter of the model `config` describes, without building it."""
    T, L, D = config.block_size, config.n_layer, config.n_embd
    rows, adjustments = _gpt3_rows(config), _adjustments(config)
    gpt3_total = sum(r.count for r in rows)
    exact_total = gpt3_total + sum(r.count for r in adjustments)
    shares = _shares(config)
    assert sum(shares.values()) == exact_total
    # AdamW in mixed precision keeps fp32 weights, fp32 grads and two fp32 moments: 16 bytes/param
    memory_bytes = {
        "weights_fp32": 4 * exact_total,
        "weights_bf16": 2 * exact_total,
        "training_adamw": 16 * exact_total,
    }
    # PaLM appendix B: N excludes position embeddings (a lookup, not a matmul); attention adds
    # 2 matmuls (QK^T, AV) of 2·T·D FLOPs per layer per token at full context
    forward = 2 * (exact_total - T * D) + 4 * L * D * T
    kv_per_token = 2 * L * D  # one key and one value vector per layer
    kv_cache_bytes = {
        "per_token_bf16": 2 * kv_per_token,
        "per_token_fp32": 4 * kv_per_token,
        "full_context_bf16": 2 * kv_per_token * T,
        "full_context_fp32": 4 * kv_per_token * T,
    }
    return ParamReport(
        config=config, rows=rows, gpt3_total=gpt3_total, adjustments=adjustments, exact_total=exact_total,
        shares=shares, memory_bytes=memory_bytes, flops_per_token={"forward": forward, "training": 3 * forward},
        kv_cache_bytes=kv_cache_bytes, formulas=dict(FORMULAS),
    )  # fmt: skip
