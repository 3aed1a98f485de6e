"""Analytic parameter, memory and FLOP accounting for a GPTConfig (GPT-3 style breakdown)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from minigpt.model.config import GPTConfig
from minigpt.model.weights import expected_shapes, is_hidden_matrix


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
    """The parts of the GPT-3 style table (Kaplan et al.'s accounting of a transformer), with a gate row
    for SwiGLU and key/value rows of n_kv_head heads for grouped-query attention."""
    V, L, H, D, hd, F = (
        config.vocab_size,
        config.n_layer,
        config.n_head,
        config.n_embd,
        config.head_dim,
        config.d_ff,
    )
    KV = config.kv_heads
    layers = f"{_n(L)} layers"
    query_rows = f"{_n(hd)} × {_n(D)} × {_n(H)} heads × {layers}"
    kv_rows = query_rows if KV == H else f"{_n(hd)} × {_n(D)} × {_n(KV)} heads (n_kv_head) × {layers}"
    mlp_rows = [Row("Up-projection", f"{_n(D)} × {_n(F)} × {layers}", D * F * L)]
    if config.mlp == "swiglu":
        mlp_rows.append(Row("Gate-projection (SwiGLU)", f"{_n(D)} × {_n(F)} × {layers}", D * F * L))
    return [
        Row("Embedding", f"{_n(V)} × {_n(D)}", V * D),
        Row("Key", kv_rows, D * hd * KV * L),
        Row("Query", query_rows, D * hd * H * L),
        Row("Value", kv_rows, D * hd * KV * L),
        Row("Output", f"{_n(hd)} × {_n(H)} heads × {_n(D)} × {layers}", hd * H * D * L),
        *_score_rows(config),
        *mlp_rows,
        Row("Down-projection", f"{_n(F)} × {_n(D)} × {layers}", F * D * L),
        Row("Unembedding", f"{_n(D)} × {_n(V)}", D * V),
    ]


def _score_rows(config: GPTConfig) -> list[Row]:
    """The attention score's own parameters: general's W (d_head² a head), additive's W₁, W₂ and v."""
    H, L, hd, da = config.n_head, config.n_layer, config.head_dim, config.additive_width
    heads = f"{_n(H)} heads × {_n(L)} layers"
    if config.attn_score == "general":
        return [Row("Score map W (general)", f"{_n(hd)} × {_n(hd)} × {heads}", hd * hd * H * L)]
    if config.attn_score == "additive":
        return [
            Row("Score W₁ (additive, queries)", f"{_n(da)} × {_n(hd)} × {heads}", da * hd * H * L),
            Row("Score W₂ (additive, keys)", f"{_n(da)} × {_n(hd)} × {heads}", da * hd * H * L),
            Row("Score v (additive)", f"{_n(da)} × {heads}", da * H * L),
        ]
    return []


def _bias_widths(config: GPTConfig) -> tuple[int, int]:
    """Bias entries per layer in attention (fused q/k/v, output) and in the MLP (up, gate, down)."""
    if not config.bias:
        return 0, 0
    D, F = config.n_embd, config.d_ff
    qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
    return qkv + D, F * (2 if config.mlp == "swiglu" else 1) + D


def _norm_width(config: GPTConfig) -> int:
    """Entries per norm: LayerNorm's gain and bias (with --bias), RMSNorm's gain alone."""
    return 2 * config.n_embd if config.bias and config.norm == "layernorm" else config.n_embd


def _adjustments(config: GPTConfig) -> list[Row]:
    """What the module holds beyond the GPT-3 table: positions, biases, norms, less a tied head."""
    V, T, L, D, F, hd = (
        config.vocab_size, config.block_size, config.n_layer, config.n_embd, config.d_ff, config.head_dim,
    )  # fmt: skip
    layers = f"{_n(L)} layers"
    if config.pos == "learned":
        rows = [Row("Position embeddings", f"{_n(T)} × {_n(D)}", T * D)]
    else:
        rows = [Row("Position embeddings", "none: rotary positions are computed", 0)]
    attn_bias, mlp_bias = _bias_widths(config)
    if config.bias:
        qkv = f"({_n(config.n_head)} + 2 × {_n(config.kv_heads)}) × {_n(hd)}"
        mlp = f"{_n(F)} + {_n(F)}" if config.mlp == "swiglu" else _n(F)
        biases = f"({qkv} + {_n(D)} + {mlp} + {_n(D)}) × {layers}"
        rows.append(Row("Linear biases", biases, (attn_bias + mlp_bias) * L))
    if config.norm == "layernorm":
        name, kind = "LayerNorms", "gain + bias" if config.bias else "gain"
    else:
        name, kind = "RMSNorms", "gain"
    rows.append(Row(name, f"(2 × {layers} + 1) × {_n(D)} ({kind})", (2 * L + 1) * _norm_width(config)))
    if config.qk_norm:
        rows.append(Row("QK-norm gains", f"2 (query, key) × {_n(hd)} × {layers}", 2 * hd * L))
    if config.value_embeds:
        formula = f"{_n(V)} × {_n(config.kv_heads)} kv heads × {_n(hd)} × {layers}"
        rows.append(Row("Value embeddings", formula, _value_embeds(config)))
    if config.skips:
        rows.append(Row("U-net skip weights", f"{_n(L)} layers // 2", L // 2))
    if config.tie_embeddings:
        rows.append(Row("Tied unembedding (shares wte)", f"−{_n(D)} × {_n(V)}", -D * V))
    return rows


def _value_embeds(config: GPTConfig) -> int:
    """Entries of the value embeddings: a (vocab, n_kv_head x head_dim) table per layer, or none."""
    if not config.value_embeds:
        return 0
    return config.vocab_size * config.kv_heads * config.head_dim * config.n_layer


def _shares(config: GPTConfig) -> dict[str, int]:
    """Where the parameters are; QK-norm gains count as attention, value embeddings as embeddings, U-net
    skip weights with the norms' gains, every other norm as norms."""
    V, T, L, D, F, hd = (
        config.vocab_size, config.block_size, config.n_layer, config.n_embd, config.d_ff, config.head_dim,
    )  # fmt: skip
    attn_bias, mlp_bias = _bias_widths(config)
    projections = (config.n_head + 2 * config.kv_heads) * hd * D + D * D
    matrices = 3 if config.mlp == "swiglu" else 2
    score = sum(r.count for r in _score_rows(config))
    return {
        "attention": (projections + attn_bias + (2 * hd if config.qk_norm else 0)) * L + score,
        "mlp": (matrices * D * F + mlp_bias) * L,
        "embeddings": V * D
        + (T * D if config.pos == "learned" else 0)
        + (0 if config.tie_embeddings else D * V)
        + _value_embeds(config),
        "norms": (2 * L + 1) * _norm_width(config) + len(config.skip_pairs),
    }


FORMULAS = {
    "memory": "weights: 4 B (fp32) or 2 B (bf16) per parameter; training with AdamW: 16 B per "
    "parameter (fp32 weights, gradients and two moments); with Muon on the blocks' matrices (AdamW on the "
    "rest): 12 B per parameter of those (one momentum buffer), activations not included",
    "flops": "forward = 2·N + 4·n_embd·Σ_layers min(window, block_size), training = 3 × forward (PaLM, "
    "appendix B), N = parameters less position and value embeddings (lookups); a full-attention layer's "
    "window is block_size; the additive score costs 4·n_head·d_a + 2·n_embd a key rather than 4·n_embd (a "
    "query-key pair: d_a additions, tanhs and multiply-adds with v, so v counts there, not in N)",
    "kv_cache": "per token: 2 (key, value) × n_kv_head × head_dim × n_layer × bytes per element; full "
    "context: 2 × n_kv_head × head_dim × Σ_layers min(window, block_size) × bytes (a local layer keeps "
    "only its window)",
}


def count_params(config: GPTConfig) -> ParamReport:
    """Count every parameter of the model `config` describes, without building it."""
    T, L, D = config.block_size, config.n_layer, config.n_embd
    rows, adjustments = _gpt3_rows(config), _adjustments(config)
    gpt3_total = sum(r.count for r in rows)
    exact_total = gpt3_total + sum(r.count for r in adjustments)
    shares = _shares(config)
    assert sum(shares.values()) == exact_total
    # AdamW in mixed precision keeps fp32 weights, fp32 grads and two fp32 moments: 16 bytes/param; Muon
    # keeps one fp32 momentum buffer for the matrices it trains
    muon = sum(math.prod(s) for n, s in expected_shapes(config).items() if is_hidden_matrix(n, len(s)))
    memory_bytes = {
        "weights_fp32": 4 * exact_total,
        "weights_bf16": 2 * exact_total,
        "training_adamw": 16 * exact_total,
        "training_muon": 16 * exact_total - 4 * muon,
    }
    # PaLM appendix B: N excludes position (and value) embeddings, lookups, not matmuls; attention adds 2 matmuls
    # (QKᵀ, AV) of 2·keys·D FLOPs per layer per token, keys being the layer's window at full context
    # (grouped-query attention shares keys between heads but every query head still multiplies them)
    lookups = (T * D if config.pos == "learned" else 0) + _value_embeds(config)
    forward = 2 * (exact_total - lookups) + 4 * D * config.cached_positions
    if config.attn_score == "additive":
        H, da = config.n_head, config.additive_width
        forward += (4 * H * da - 2 * D) * config.cached_positions - 2 * H * da * L
    kv_width = 2 * config.kv_heads * config.head_dim  # one key and one value vector per position
    kv_cache_bytes = {
        "per_token_bf16": 2 * kv_width * L,
        "per_token_fp32": 4 * kv_width * L,
        "full_context_bf16": 2 * kv_width * config.cached_positions,
        "full_context_fp32": 4 * kv_width * config.cached_positions,
    }
    return ParamReport(
        config=config, rows=rows, gpt3_total=gpt3_total, adjustments=adjustments, exact_total=exact_total,
        shares=shares, memory_bytes=memory_bytes, flops_per_token={"forward": forward, "training": 3 * forward},
        kv_cache_bytes=kv_cache_bytes, formulas=dict(FORMULAS),
    )  # fmt: skip
