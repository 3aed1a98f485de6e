"""Hugging Face Llama and Qwen3 interop: to-hf and from-hf of rotary models against transformers (offline)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test-only dependency (the dev extra)

from conftest import slow_but  # noqa: E402
from numerics import assert_near_exact, float64_logits  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_convert import greedy, hf_greedy  # noqa: E402

from minigpt.cli.main import app  # noqa: E402
from minigpt.convert.hf import expected_hf_shapes  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.tokenizer.bpe import GPT2_SPLIT_PATTERN, BPETokenizer  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402

torch.set_num_threads(1)

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n" for i, w in enumerate("abcd" * 30)
)
ROTARY = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, rope_base=500.0, layer_norm_eps=1e-5)
SHAPE = dict(block_size=32, n_layer=3, n_head=4, n_embd=32)
CASES = {
    "llama": ("LlamaForCausalLM", dict(tie_embeddings=False)),
    "llama-gqa-tied-bias": ("LlamaForCausalLM", dict(n_kv_head=2, bias=True, mlp_width=48)),
    "llama-mqa": ("LlamaForCausalLM", dict(n_kv_head=1, tie_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", dict(qk_norm=True, n_kv_head=2, tie_embeddings=False)),
    "qwen3-windows": ("Qwen3ForCausalLM", dict(qk_norm=True, n_layer=5, window=6, window_pattern="SSL")),
}


def one_line_error(result: Any) -> str:
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def randomized(model: GPT, seed: int = 0) -> GPT:
    """Every tensor random, gains and biases included, so a misplaced one cannot pass unnoticed."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def minigpt_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, all_logits=True)[0]


def assert_same_as_transformers(ours: GPT, theirs: Any) -> None:
    """Logits over a whole block, ours and transformers' (both float32), each within the float32 bound of
    our model computed in float64 (numerics.py); and the same greedy continuation (past every window)."""
    ids = torch.randint(
        0, ours.config.vocab_size, (2, ours.config.block_size), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = theirs(ids).logits
    exact = float64_logits(ours, ids, all_logits=True)
    assert_near_exact(minigpt_logits(ours, ids), exact, ours.config, "minigpt")
    assert_near_exact(expected, exact, ours.config, "transformers")
    prompt = ids[0, :5].tolist()
    assert greedy(ours, prompt, 24) == hf_greedy(theirs, prompt, 24)


def save_run(path: Path, config: dict[str, Any], kind: str = "char") -> GPT:
    tok = CharTokenizer.from_text(TEXT) if kind == "char" else BPETokenizer.train([TEXT], vocab_size=300)
    model = randomized(GPT(GPTConfig(vocab_size=tok.vocab_size, **{**SHAPE, **ROTARY, **config})))
    RunDir(path).save(model, tok, {})
    return model


@pytest.mark.parametrize("case", slow_but(CASES, "llama"))
def test_round_trip_through_transformers(case: str, tmp_path: Path, runner) -> None:
    """minigpt run -> to-hf -> transformers (same logits, same greedy text) -> from-hf -> the same run."""
    architecture, options = CASES[case]
    run, out, back = tmp_path / "run", tmp_path / "hf", tmp_path / "back"
    ours = save_run(run, options, "bpe" if "gqa" in case else "char")
    result = runner.invoke(app, ["convert", "to-hf", str(run), str(out)])
    assert result.exit_code == 0, result.output
    assert f"{architecture}," in result.stderr
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == [architecture] and hf["head_dim"] == 8
    assert hf["intermediate_size"] == ours.config.d_ff and hf["num_key_value_heads"] == ours.config.kv_heads
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == architecture
    assert not any(info.values()), info
    assert theirs.config.rope_parameters["rope_theta"] == 500.0
    if ours.config.tie_embeddings:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    if ours.config.window:
        assert theirs.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] + [
            "sliding_attention",
            "full_attention",
        ]
    assert_same_as_transformers(ours, theirs.eval())

    result = runner.invoke(app, ["convert", "from-hf", str(out), str(back)])
    assert result.exit_code == 0, result.output
    again, tok, _ = RunDir(back).load_model()
    assert again.config == ours.config  # window pattern, rope base and eps included
    assert tok.to_json() == RunDir(run).tokenizer().to_json()
    state = again.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())
    ids = torch.randint(0, ours.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    assert torch.equal(minigpt_logits(again.eval(), ids), minigpt_logits(ours, ids))


def tiny_ranks_file(tmp_path: Path) -> Path:
    bpe = BPETokenizer.train([TEXT], vocab_size=300, pattern=GPT2_SPLIT_PATTERN)
    path = tmp_path / "tiny.tiktoken"
    ranks = sorted(bpe.ranks.items(), key=lambda kv: kv[1])
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks))
    return path


def transformers_model(model_type: str, **overrides: Any) -> Any:
    """A random Llama or Qwen3 made by transformers itself, every tensor perturbed."""
    config_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
    config = config_class(
        vocab_size=320, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", dict(tie_word_embeddings=True)),
        pytest.param("llama", dict(attention_bias=True, mlp_bias=True), marks=pytest.mark.slow),
        pytest.param("qwen3", dict(tie_word_embeddings=False), marks=pytest.mark.slow),
        pytest.param(
            "qwen3",
            dict(
                use_sliding_window=True,
                sliding_window=5,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_from_hf_of_models_transformers_made(
    model_type: str, overrides: dict, tmp_path: Path, runner
) -> None:
    theirs = transformers_model(model_type, **overrides)
    src, out = tmp_path / "hf", tmp_path / "run"
    theirs.save_pretrained(src)
    result = runner.invoke(
        app, ["convert", "from-hf", str(src), str(out), "--tokenizer-file", str(tiny_ranks_file(tmp_path))]
    )
    assert result.exit_code == 0, result.output
    ours, _, _ = RunDir(out).load_model()
    c = ours.config
    assert (c.pos, c.norm, c.mlp, c.qk_norm, c.n_kv_head, c.rope_base) == (
        "rope",
        "rmsnorm",
        "swiglu",
        model_type == "qwen3",
        2,
        1000.0,
    )
    if "layer_types" in overrides:
        assert (c.window, c.window_pattern, c.layer_windows) == (5, "SL", (5, 32, 5, 32))
    assert_same_as_transformers(ours.eval(), theirs)
    assert json.loads((out / "config.json").read_text())["source"]["model_type"] == model_type


def _broken(src: Path, dst: Path, name: str, config: dict | None = None, drop: str | None = None) -> Path:
    d = dst / name
    d.mkdir(parents=True)
    hf = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    tensors = {
        k: v for k, v in load_file(str(src / "model.safetensors")).items() if drop is None or drop not in k
    }
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(
    "name, config, drop, words",
    [
        ("head_dim", {"head_dim": 16}, None, "head_dim 16 is not hidden_size / num_attention_heads (32 / 4)"),
        (
            "scaled",
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            None,
            "rope_type 'llama3'",
        ),
        ("act", {"hidden_act": "gelu"}, None, "hidden_act 'gelu'"),
        ("bias", {"attention_bias": True}, None, "attention_bias=True but mlp_bias=False"),
        (
            "missing",
            None,
            "layers.1.mlp.gate_proj",
            "lacks tensors a Llama of this config needs: model.layers.1.mlp.gate_proj.weight",
        ),
        ("notokenizer", None, None, "no tokenizer files minigpt reads"),
    ],
)
def test_bad_llama_directories_are_one_line_errors(
    name: str, config: dict | None, drop: str | None, words: str, tmp_path: Path, runner
) -> None:
    src = tmp_path / "good"
    transformers_model("llama").save_pretrained(src)
    bad = _broken(src, tmp_path / "bad", name, config, drop)
    args = ["convert", "from-hf", str(bad), str(tmp_path / "out")]
    if name != "notokenizer":
        args += ["--tokenizer-file", str(tiny_ranks_file(tmp_path))]
    assert words in one_line_error(runner.invoke(app, args))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(mlp="relu2"), "--mlp relu2; rotary models map to LlamaForCausalLM or Qwen3ForCausalLM"),
        (dict(mlp="gelu"), "--mlp gelu"),
        (dict(norm="layernorm"), "--norm layernorm"),
        (dict(window=8, window_pattern="SL"), "--window 8; LlamaForCausalLM has no local attention"),
        (dict(qk_norm=True, bias=True), "Qwen3ForCausalLM (--qk-norm) has no MLP biases"),
        (dict(pos="learned", bias=True), "--norm rmsnorm; learned positions map only to GPT-2"),
        (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, n_kv_head=2), "--n-kv-head 2"),
        (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, qk_norm=True), "--qk-norm"),
        (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, window=4), "--window 4"),
        (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, mlp_width=64), "MLP width of 64"),
    ],
)
def test_options_transformers_cannot_hold_are_one_line_errors(
    options: dict, words: str, tmp_path: Path, runner
) -> None:
    tok = CharTokenizer.from_text(TEXT)
    RunDir(tmp_path / "run").save(
        GPT(GPTConfig(vocab_size=tok.vocab_size, **{**SHAPE, **ROTARY, **options})), tok, {}
    )
    line = one_line_error(
        runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    )
    assert line.startswith("error: cannot convert to Hugging Face: this model has ") and words in line, line
    assert not (tmp_path / "hf").exists()


def test_expected_shapes_split_the_fused_projection() -> None:
    config = GPTConfig(vocab_size=10, **SHAPE, **{**ROTARY, "n_kv_head": 1, "qk_norm": True})
    shapes = expected_hf_shapes(config)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 32)
    assert (
        shapes["model.layers.0.self_attn.k_proj.weight"]
        == shapes["model.layers.0.self_attn.v_proj.weight"]
        == (8, 32)
    )
    assert shapes["model.layers.2.self_attn.k_norm.weight"] == (8,) and "lm_head.weight" not in shapes
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (config.d_ff, 32)
