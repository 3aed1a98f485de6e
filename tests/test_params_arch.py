"""Parameter, KV-cache and FLOP accounting of every architecture option, held to the module's own tensors."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from minigpt.cli.main import app
from minigpt.model.config import SCORES, GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.params import count_params

# (n_layer, n_head, n_embd, vocab_size, block_size): heads of 1 and 8 wide, several kv-head divisors
SHAPES = [(1, 2, 16, 11, 8), (3, 4, 32, 65, 16), (4, 8, 64, 97, 32)]
OPTIONS = dict(
    pos=["learned", "rope"],
    norm=["layernorm", "rmsnorm"],
    mlp=["gelu", "relu2", "swiglu"],
    qk_norm=[False, True],
    bias=[False, True],
    tie_embeddings=[False, True],
)


def configs() -> list[GPTConfig]:
    """Every option combination on every shape, with full, grouped and multi-query attention and windows,
    the attention scores, value embeddings and U-net skips taking turns (so each meets the others)."""
    out = []
    for (L, H, D, V, T), values in itertools.product(SHAPES, itertools.product(*OPTIONS.values())):
        options = dict(zip(OPTIONS, values, strict=True))
        for kv, window in ((None, None), (H // 2, T // 4), (1, T // 2)):
            out.append(
                GPTConfig(
                    n_layer=L,
                    n_head=H,
                    n_embd=D,
                    vocab_size=V,
                    block_size=T,
                    n_kv_head=kv,
                    window=window,
                    window_pattern="SL",
                    attn_score=SCORES[len(out) % len(SCORES)],
                    value_embeds=len(out) // len(SCORES) % 2 == 1,
                    skips=L > 1 and len(out) // (2 * len(SCORES)) % 2 == 1,
                    **options,
                )  # fmt: skip
            )
    return out


def module_rows(model: GPT) -> tuple[dict[str, int], dict[str, int]]:
    """The table's rows and the shares counted from the module's tensors themselves."""
    c = model.config
    q_rows, kv_rows = c.n_head * c.head_dim, c.kv_heads * c.head_dim
    names = ("Embedding", "Key", "Query", "Value", "Output", "Up-projection", "Down-projection")
    names += ("Unembedding", "Position embeddings", "Linear biases", "norms", "QK-norm gains")
    rows = dict.fromkeys(names, 0)
    shares = dict.fromkeys(("attention", "mlp", "embeddings", "norms"), 0)
    for name, p in model.named_parameters(remove_duplicate=False):
        n = p.numel()
        shares[_share(name)] += n if name != "lm_head.weight" or not c.tie_embeddings else 0
        if name.endswith("c_attn.weight"):
            q, k, v = p.split([q_rows, kv_rows, kv_rows])
            rows["Query"] += q.numel()
            rows["Key"] += k.numel()
            rows["Value"] += v.numel()
        elif name.endswith(".bias") and ".ln_" not in name and "ln_f" not in name:
            rows["Linear biases"] += n
        elif "q_norm" in name or "k_norm" in name:
            rows["QK-norm gains"] += n
        elif "ln_" in name:
            rows["norms"] += n
        else:
            part = _row(name)
            rows[part] = rows.get(part, 0) + n
    return rows, shares


def _row(name: str) -> str:
    suffixes = {
        "wte.weight": "Embedding",
        "wpe.weight": "Position embeddings",
        "attn.c_proj.weight": "Output",
        "mlp.c_fc.weight": "Up-projection",
        "mlp.c_gate.weight": "Gate-projection (SwiGLU)",
        "mlp.c_proj.weight": "Down-projection",
        "lm_head.weight": "Unembedding",
        "attn.v_embed.weight": "Value embeddings",
        "skip_weights": "U-net skip weights",
        "attn.score.weight": "Score map W (general)",
        "attn.score_q.weight": "Score W₁ (additive, queries)",
        "attn.score_k.weight": "Score W₂ (additive, keys)",
        "attn.score_v.weight": "Score v (additive)",
    }
    return next(row for suffix, row in suffixes.items() if name.endswith(suffix))


def _share(name: str) -> str:
    if name.endswith("v_embed.weight"):
        return "embeddings"
    if name == "skip_weights":
        return "norms"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms" if "ln_" in name else "embeddings"


def report_rows(config: GPTConfig) -> tuple[dict[str, int], dict[str, int]]:
    report = count_params(config)
    rows = {r.name: r.count for r in report.rows}
    adjust = {r.name: r.count for r in report.adjustments}
    rows["norms"] = adjust.pop("LayerNorms" if config.norm == "layernorm" else "RMSNorms")
    tied = adjust.pop("Tied unembedding (shares wte)", 0)
    assert tied == (-config.n_embd * config.vocab_size if config.tie_embeddings else 0)
    rows.update(adjust)
    rows.setdefault("Linear biases", 0)
    rows.setdefault("QK-norm gains", 0)
    return rows, report.shares


@pytest.mark.slow
def test_every_combination_counts_exactly_per_row() -> None:
    """On a grid of shapes, every option combination: the total equals the module's, each row equals the
    tensors it names (the gate row the gate tensors, key and value the k and v rows of the fused
    projection), and the shares sum to the total."""
    torch.manual_seed(0)
    checked = 0
    for config in configs():
        with torch.device("meta"):
            model = GPT(config)
        report = count_params(config)
        assert report.exact_total == model.num_params(), config
        assert sum(report.shares.values()) == report.exact_total
        expected_rows, expected_shares = module_rows(model)
        rows, shares = report_rows(config)
        assert rows == expected_rows, config
        assert shares == expected_shares, config
        checked += 1
    assert checked == len(SHAPES) * 96 * 3


@pytest.mark.parametrize(
    "options",
    [dict(value_embeds=True), dict(skips=True), dict(value_embeds=True, skips=True, n_kv_head=2, pos="rope")],
)
def test_value_embeddings_and_skips_count_exactly_per_row(options: dict) -> None:
    """Value embeddings (a table per layer, as wide as the keys) and U-net skip weights (one per pair of
    layers) are rows of the reconciliation, counted as the module holds them."""
    for L, H, D, V, T in SHAPES[1:]:
        config = GPTConfig(n_layer=L, n_head=H, n_embd=D, vocab_size=V, block_size=T, **options)
        with torch.device("meta"):
            model = GPT(config)
        report = count_params(config)
        assert report.exact_total == model.num_params()
        assert report_rows(config) == module_rows(model), config


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(pos="rope", n_kv_head=2, window=4, window_pattern="SSL"),
        dict(pos="rope", n_kv_head=1, window=8, window_pattern="S"),
        dict(window=16, window_pattern="L"),
    ],
)
def test_kv_cache_and_flops_follow_heads_and_windows(options: dict) -> None:
    """KV-cache bytes are the cache minigpt allocates; attention FLOPs sum each layer's window."""
    config = GPTConfig(n_layer=5, n_head=4, n_embd=32, vocab_size=50, block_size=16, **options)
    report = count_params(config)
    with torch.device("meta"):
        model = GPT(config)
    cache = model.new_cache(1)
    cached = sum(t.numel() for t in (*cache.k, *cache.v))
    assert report.kv_cache_bytes["full_context_fp32"] == 4 * cached
    assert report.kv_cache_bytes["full_context_bf16"] == 2 * cached
    assert (
        report.kv_cache_bytes["per_token_fp32"] == 4 * 2 * config.kv_heads * config.head_dim * config.n_layer
    )
    positions = config.block_size * config.n_embd if config.pos == "learned" else 0
    attention = sum(4 * config.n_embd * min(w, config.block_size) for w in config.layer_windows)
    assert report.flops_per_token["forward"] == 2 * (report.exact_total - positions) + attention
    assert report.flops_per_token["training"] == 3 * report.flops_per_token["forward"]


def test_params_cli_architecture_flags(runner) -> None:
    """The train flags (and --arch, which they override) shape the count; JSON carries the new rows."""
    args = ["params", "--preset", "mini", "--vocab-size", "65", "--arch", "modern", "--qk-norm", "--no-bias"]
    args += ["--n-kv-head", "2", "--window", "16", "--window-pattern", "SSL", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    c = data["config"]
    assert (c["pos"], c["norm"], c["mlp"], c["qk_norm"], c["tie_embeddings"], c["bias"]) == (
        "rope", "rmsnorm", "swiglu", True, False, False,
    )  # fmt: skip
    assert (c["n_kv_head"], c["window"], c["window_pattern"]) == (2, 16, "SSL")
    config = GPTConfig.from_dict(c)
    with torch.device("meta"):
        assert data["exact_total"] == GPT(config).num_params()
    rows = {r["name"]: r for r in data["breakdown"]}
    assert rows["Gate-projection (SwiGLU)"]["count"] == 4 * 128 * config.d_ff
    assert "2 heads (n_kv_head)" in rows["Key"]["formula"] and rows["Key"]["count"] == 4 * 128 * 64
    adjustments = {r["name"]: r["count"] for r in data["adjustments"]}
    assert adjustments["Position embeddings"] == 0 and adjustments["QK-norm gains"] == 2 * 32 * 4
    assert "RMSNorms" in adjustments and "Tied unembedding (shares wte)" not in adjustments
    assert data["kv_cache_bytes"]["full_context_fp32"] == 4 * 2 * 2 * 32 * (2 * 16 + 2 * 64)

    # --tie/--untie as train spells them, --tied/--untied as params always did; a flag overrides --arch
    for flag, tied in (("--tie", True), ("--tied", True), ("--untie", False), ("--untied", False)):
        result = runner.invoke(app, ["params", "--preset", "tiny", "--arch", "modern", flag, "--json"])
        assert json.loads(result.stdout)["config"]["tie_embeddings"] is tied, flag
    table = runner.invoke(app, ["params", "--preset", "tiny", "--mlp", "swiglu", "--n-kv-head", "1"])
    assert table.exit_code == 0 and "Gate-projection" in table.output and "n_kv_head" in table.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--arch", "llama"], "invalid value for '--arch': 'llama' is not one of 'gpt2', 'modern'"),
        (["--mlp", "geglu"], "invalid value for '--mlp': 'geglu' is not one of"),
        (["--n-head", "4", "--n-kv-head", "3"], "must divide n_head"),
        (["--preset", "tiny", "--window", "64"], "at most block_size"),
        (["--window-pattern", "SX"], "window_pattern"),
    ],
)
def test_params_cli_bad_architecture_is_one_line(runner, args: list[str], words: str) -> None:
    result = runner.invoke(app, ["params", *args])
    assert result.exit_code in (1, 2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], result.output
