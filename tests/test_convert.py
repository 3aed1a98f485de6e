"""Hugging Face GPT-2 interop: from-hf and to-hf against transformers itself (offline, tiny models)."""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test-only dependency (the dev extra)

from conftest import R50K_FILE, ROOT  # noqa: E402
from numerics import assert_near_exact, float64_logits  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer  # noqa: E402

from minigpt.cli.main import app  # noqa: E402
from minigpt.common.files import load_tensors  # noqa: E402
from minigpt.convert.hf import config_from_hf, expected_hf_shapes  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.model.params import count_params  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.tokenizer.bpe import GPT2_SPLIT_PATTERN, BPETokenizer, TiktokenTokenizer  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402
from minigpt.tokenizer.hf import HF_MERGES, HF_VOCAB, bpe_vocab_merges, ranks_from_vocab_merges  # noqa: E402

torch.set_num_threads(1)

SAMPLE = (
    "Hello world! The quick brown fox jumps over the lazy dog.\n"
    "  I'm here, you're there; they'll've gone 1234 times...\n\tTabs\tand  double  spaces   \n"
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🙂👍🏽 and math ∑x².\r\nThe end   "
)
TRAIN_TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n"
    for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 40)
)
SMALL = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, layer_norm_epsilon=1e-3)


def one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def greedy(model: GPT, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by hand: argmax of the last position's logits, appended, n times."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx[0].tolist()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' own generate (any causal LM class)."""
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0].tolist()


def assert_same_model(ours: GPT, theirs: GPT2LMHeadModel, vocab: int) -> None:
    theirs.eval()
    ours.eval()
    ids = torch.randint(0, vocab, (2, ours.config.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got, _ = ours(ids, all_logits=True)
    exact = float64_logits(ours, ids, all_logits=True)  # both float32 within the bound of it (numerics.py)
    assert_near_exact(got, exact, ours.config, "minigpt")
    assert_near_exact(expected, exact, ours.config, "transformers")
    prompt = ids[0, :5].tolist()
    assert greedy(ours, prompt, 20) == hf_greedy(theirs, prompt, 20)


def random_hf(vocab: int, seed: int = 0, **kw) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with every tensor random (HF's init leaves biases 0 and LayerNorm gains 1)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, bos_token_id=None, eos_token_id=None, **{**SMALL, **kw})
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_ranks_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE with GPT-2's split pattern, as a .tiktoken ranks file (no ../shared needed)."""
    bpe = BPETokenizer.train([TRAIN_TEXT + SAMPLE], vocab_size=320, pattern=GPT2_SPLIT_PATTERN)
    path = tmp_path_factory.mktemp("tok") / "tiny.tiktoken"
    lines = [
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(bpe.ranks.items(), key=lambda kv: kv[1])
    ]
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def tiny_tok(tiny_ranks_file: Path) -> TiktokenTokenizer:
    return TiktokenTokenizer.from_file(tiny_ranks_file)


@pytest.fixture(scope="module")
def hf_model(tiny_tok: TiktokenTokenizer) -> GPT2LMHeadModel:
    return random_hf(tiny_tok.vocab_size)


@pytest.fixture(scope="module")
def hf_dir(hf_model: GPT2LMHeadModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def converted(hf_dir: Path, tiny_ranks_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from typer.testing import CliRunner

    out = tmp_path_factory.mktemp("runs") / "converted"
    result = CliRunner().invoke(
        app, ["convert", "from-hf", str(hf_dir), str(out), "--tokenizer-file", str(tiny_ranks_file)]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stderr
    return out


@pytest.fixture(scope="module")
def finetuned(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted model fine-tuned for a few steps through `minigpt train --init-from`."""
    from typer.testing import CliRunner

    tmp = tmp_path_factory.mktemp("ft")
    text = tmp / "text.txt"
    text.write_text(TRAIN_TEXT, encoding="utf-8")
    out = tmp / "run"
    args = ["train", str(text), "--init-from", str(converted), "--out", str(out), "--max-iters", "4"]
    args += ["--batch-size", "2", "--eval-every", "2", "--eval-iters", "1", "--lr", "1e-2", "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


# ---------------------------------------------------------------- from-hf


def test_from_hf_logits_and_greedy_match_transformers(converted: Path, hf_model: GPT2LMHeadModel) -> None:
    model, tok, data = RunDir(converted).load_model()
    assert model.config == GPTConfig(
        vocab_size=hf_model.config.vocab_size,
        block_size=64,
        n_layer=2,
        n_head=2,
        n_embd=32,
        layer_norm_eps=1e-3,
    )
    assert data["source"]["kind"] == "huggingface" and tok.name == "tiny"
    assert_same_model(model, hf_model, tok.vocab_size)


def test_from_hf_original_layout_with_mask_buffers(
    hf_model: GPT2LMHeadModel, converted: Path, tiny_ranks_file: Path, tmp_path: Path, runner
) -> None:
    """The hub's original files: no 'transformer.' prefix, attn.bias/masked_bias buffers, lm_head stored."""
    src = tmp_path / "old"
    src.mkdir()
    sd = {k.removeprefix("transformer."): v.contiguous() for k, v in hf_model.state_dict().items()}
    sd["lm_head.weight"] = sd["wte.weight"].clone()
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file({k: v.half() for k, v in sd.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    hf = hf_model.config.to_dict()
    (src / "config.json").write_text(json.dumps({**hf, "architectures": ["GPT2Model"]}))
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["convert", "from-hf", str(src), str(out), "--tokenizer", str(tiny_ranks_file)]
    )
    assert result.exit_code == 0, result.output
    got = load_file(str(out / RunDir.WEIGHTS))
    want = load_file(str(converted / RunDir.WEIGHTS))
    assert got.keys() == want.keys()
    for k in want:  # stored as float16 above: equal to its rounding
        torch.testing.assert_close(got[k], want[k].half().float(), rtol=0, atol=0)


def test_sharded_safetensors(
    hf_dir: Path, converted: Path, tiny_ranks_file: Path, tmp_path: Path, runner
) -> None:
    """A checkpoint save_pretrained split into shards (gpt2-xl with a small max_shard_size)."""
    sd = load_file(str(hf_dir / "model.safetensors"))
    src = tmp_path / "sharded"
    src.mkdir()
    (src / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(src / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["convert", "from-hf", str(src), str(out), "--tokenizer-file", str(tiny_ranks_file)]
    )
    assert result.exit_code == 0, result.output
    assert (out / RunDir.WEIGHTS).read_bytes() == (converted / RunDir.WEIGHTS).read_bytes()


@pytest.mark.slow
def test_untied_head_both_ways(
    tiny_tok: TiktokenTokenizer, tiny_ranks_file: Path, tmp_path: Path, runner
) -> None:
    theirs = random_hf(tiny_tok.vocab_size, seed=3, tie_word_embeddings=False)
    assert theirs.lm_head.weight.data_ptr() != theirs.transformer.wte.weight.data_ptr()
    theirs.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["convert", "from-hf", str(tmp_path / "hf"), str(run), "--tokenizer-file", str(tiny_ranks_file)]
    )
    assert result.exit_code == 0, result.output
    ours, _, _ = RunDir(run).load_model()
    assert not ours.config.tie_embeddings
    assert_same_model(ours, theirs, tiny_tok.vocab_size)

    result = runner.invoke(app, ["convert", "to-hf", str(run), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    back, info = GPT2LMHeadModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    assert not back.config.tie_word_embeddings
    assert_same_model(ours, back, tiny_tok.vocab_size)


def test_existing_out_needs_overwrite(converted: Path, hf_dir: Path, tiny_ranks_file: Path, runner) -> None:
    args = ["convert", "from-hf", str(hf_dir), str(converted), "--tokenizer-file", str(tiny_ranks_file)]
    assert "--overwrite" in one_line_error(runner.invoke(app, args))
    same = [
        "convert",
        "from-hf",
        str(hf_dir),
        str(hf_dir),
        "--overwrite",
        "--tokenizer-file",
        str(tiny_ranks_file),
    ]
    assert "OUT is the source directory" in one_line_error(runner.invoke(app, same))
    before = (converted / RunDir.WEIGHTS).read_bytes()
    result = runner.invoke(app, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (converted / RunDir.WEIGHTS).read_bytes() == before


def test_tokenizer_options(hf_dir: Path, tmp_path: Path, runner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    out = str(tmp_path / "run")
    line = one_line_error(runner.invoke(app, ["convert", "from-hf", str(hf_dir), out]))
    assert "r50k_base" in line and "--tokenizer-file" in line and "TIKTOKEN_CACHE_DIR" in line
    line = one_line_error(
        runner.invoke(app, ["convert", "from-hf", str(hf_dir), out, "--tokenizer-file", str(tmp_path / "no")])
    )
    assert "no such .tiktoken file" in line
    line = one_line_error(runner.invoke(app, ["convert", "from-hf", str(hf_dir), out, "--tokenizer", "char"]))
    assert "trained with" in line
    assert not (tmp_path / "run").exists()


def test_tokenizer_larger_than_model_is_refused(hf_dir: Path, tmp_path: Path, runner) -> None:
    bigger = BPETokenizer.train([TRAIN_TEXT + SAMPLE], vocab_size=400, pattern=GPT2_SPLIT_PATTERN)
    path = tmp_path / "big.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in bigger.ranks.items()))
    line = one_line_error(
        runner.invoke(
            app, ["convert", "from-hf", str(hf_dir), str(tmp_path / "r"), "--tokenizer-file", str(path)]
        )
    )
    assert "larger than the model's vocabulary" in line


def _bad_dirs(src: Path, dst: Path) -> None:
    """Break a copy of a good HF directory in each of the ways a user might hand us."""
    config = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))

    def make(name: str, cfg: dict | None = None, tensors: dict | None = None) -> None:
        d = dst / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config if cfg is None else cfg))
        save_file(sd if tensors is None else tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    make("mistral", {**config, "model_type": "mistral"})
    make("missing", tensors={k: v for k, v in sd.items() if "h.1.mlp.c_fc.weight" not in k})
    make("shapes", {**config, "n_embd": 64})
    make("extra", tensors={**sd, "score.weight": torch.zeros(2, 32)})
    make("inner", {**config, "n_inner": 100})
    make("relu", {**config, "activation_function": "relu"})
    (dst / "pickle").mkdir()
    (dst / "pickle" / "config.json").write_text(json.dumps(config))
    (dst / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    (dst / "noconfig").mkdir()
    make("corrupt")
    (dst / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


@pytest.mark.parametrize(
    "name, words",
    [
        ("mistral", "'mistral' model, not GPT-2, Llama or Qwen3"),
        ("missing", "lacks tensors a GPT-2 of this config needs: transformer.h.1.mlp.c_fc.weight"),
        ("shapes", "has shape"),
        ("extra", "not GPT-2's: score.weight"),
        ("inner", "n_inner 100"),
        ("relu", "activation_function 'relu'"),
        ("pickle", "re-save as safetensors"),
        ("noconfig", "no config.json"),
        ("corrupt", "corrupt"),
        ("absent", "does not exist"),
    ],
)
def test_not_gpt2_is_a_one_line_error(
    name: str, words: str, hf_dir: Path, tiny_ranks_file: Path, tmp_path: Path, runner
) -> None:
    _bad_dirs(hf_dir, tmp_path / "bad")
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "convert",
            "from-hf",
            str(tmp_path / "bad" / name),
            str(out),
            "--tokenizer-file",
            str(tiny_ranks_file),
        ],
    )
    assert result.exit_code == 1
    assert words in one_line_error(result)
    assert not out.exists()


@pytest.mark.slow
def test_errors_in_a_real_process(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    proc = subprocess.run(
        [sys.executable, "-m", "minigpt", "convert", "from-hf", str(tmp_path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a 'bert' model, not GPT-2, Llama or Qwen3 (model_type 'gpt2', 'llama', "
        "'qwen3'): only those checkpoints convert"
    ]


def test_gpt2_shapes_count_exactly() -> None:
    """The hub's config.json files (only the keys that differ between sizes matter) map to exact counts."""
    base = {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_ctx": 1024,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "architectures": ["GPT2LMHeadModel"],
    }
    sizes = {
        "gpt2": ((12, 12, 768), 124_439_808),
        "gpt2-medium": ((24, 16, 1024), 354_823_168),
        "gpt2-large": ((36, 20, 1280), 774_030_080),
        "gpt2-xl": ((48, 25, 1600), 1_557_611_200),
    }
    for name, ((n_layer, n_head, n_embd), total) in sizes.items():
        cfg = config_from_hf({**base, "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd}, Path(name))
        assert count_params(cfg).exact_total == total, name
        assert cfg.tie_embeddings and cfg.bias and cfg.block_size == 1024


def test_qwen3_layer_types_give_the_shortest_pattern_as_a_search_of_every_one_would() -> None:
    """The window pattern read from layer_types is the shortest whose repeats (the last layer full) give
    them, as trying every length in turn finds; at 4,096 layers (the most an import takes) too, at once."""

    def shortest(layers: str) -> str:  # the reference: each length in turn
        n = len(layers)
        return next(
            layers[:p] for p in range(1, n + 1) if (layers[:p] * (n // p + 1))[: n - 1] + "L" == layers
        )

    rng = random.Random(0)
    cases = ["SL", "SSL", "SLSL", "SSLSSL", "SLSSL", "LSL", "SSSSSSL"]
    cases += ["".join(rng.choice("SL") for _ in range(rng.randint(1, 40))) + "SL" for _ in range(300)]
    cases += ["".join(rng.choice("SL") for _ in range(4095)) + "L", "SSSL" * 1023 + "SSSL"]
    for layers in cases:
        types = ["sliding_attention" if c == "S" else "full_attention" for c in layers]
        hf = {"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": len(layers),
              "use_sliding_window": True, "sliding_window": 8, "layer_types": types}  # fmt: skip
        assert config_from_hf(hf, Path("config.json")).window_pattern == shortest(layers), layers


@pytest.mark.slow
def test_real_gpt2_width_converts_and_counts(tiny_ranks_file: Path, tmp_path: Path, runner) -> None:
    """gpt2's real vocabulary, context, width and heads with one block instead of 12 (~190 MB, not 500):
    `minigpt params` on the converted run reports the count the full model has less 11 blocks."""
    hf = {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 1,
        "n_head": 12,
        "architectures": ["GPT2LMHeadModel"],
    }
    src = tmp_path / "gpt2-1layer"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    shapes = expected_hf_shapes(config_from_hf(hf, src))
    save_file(
        {k: torch.zeros(s) for k, s in shapes.items()},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["convert", "from-hf", str(src), str(run), "--tokenizer-file", str(tiny_ranks_file)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(runner.invoke(app, ["params", str(run), "--json"]).stdout)
    per_block = 12 * 768**2 + 13 * 768  # attention + MLP weights and biases, two LayerNorms
    assert report["exact_total"] == report["stored_total"] == 124_439_808 - 11 * per_block


# ---------------------------------------------------------------- fine-tuning and to-hf


@pytest.mark.slow
def test_finetune_a_converted_model(finetuned: Path, converted: Path, runner) -> None:
    base, tok, _ = RunDir(converted).load_model()
    tuned, tuned_tok, data = RunDir(finetuned).load_model()
    assert tuned.config == base.config and tuned_tok.to_json() == tok.to_json()
    assert data["metrics"]["best_val_loss"] > 0
    result = runner.invoke(
        app, ["eval", str(converted), str(finetuned.parent / "text.txt"), "--json", "--max-windows", "2"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss"] > 0
    state = load_tensors(finetuned / RunDir.STATE)[0]
    assert any("exp_avg" in k or "optim" in k for k in state)
    moved = [name for name, p in tuned.state_dict().items() if not torch.equal(p, base.state_dict()[name])]
    assert len(moved) == len(base.state_dict())  # every tensor trained, starting from the converted ones


@pytest.mark.slow
def test_to_hf_of_a_trained_model(finetuned: Path, tmp_path: Path, runner, caplog) -> None:
    out = tmp_path / "hf"
    result = runner.invoke(app, ["convert", "to-hf", str(finetuned), str(out)])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr
    ours, tok, _ = RunDir(finetuned).load_model()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert config["n_inner"] is None and config["activation_function"] == "gelu_new"
    assert config["layer_norm_epsilon"] == 1e-3 and config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == config["eos_token_id"] == tok.eot_id == tok.vocab_size - 1
    transformers.logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        theirs, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    transformers.logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert set(info) >= {"missing_keys", "unexpected_keys", "mismatched_keys"} and not any(info.values()), (
        info
    )
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()
    assert_same_model(ours, theirs, tok.vocab_size)

    hf_tok = GPT2Tokenizer.from_pretrained(out)
    for text in (SAMPLE, TRAIN_TEXT[:500], " leading space", "x"):
        assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eot_id
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(SAMPLE)["input_ids"] == tok.encode(SAMPLE)

    # and back: the exported tokenizer files are read as the same tokenizer
    back = tmp_path / "back"
    result = runner.invoke(app, ["convert", "from-hf", str(out), str(back)])
    assert result.exit_code == 0, result.output
    model2, tok2, _ = RunDir(back).load_model()
    assert tok2.ranks == tok.ranks and tok2.specials == tok.specials
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in ours.state_dict().items())

    # as transformers saves it (tokenizer.json alone, merges as pairs in version 5)
    resaved = tmp_path / "resaved"
    theirs.save_pretrained(resaved)
    auto.save_pretrained(resaved)
    for name in (HF_VOCAB, HF_MERGES):
        (resaved / name).unlink(missing_ok=True)
    assert (resaved / "tokenizer.json").is_file()
    result = runner.invoke(app, ["convert", "from-hf", str(resaved), str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    tok3 = RunDir(tmp_path / "again").tokenizer()
    assert tok3.ranks == tok.ranks and tok3.specials == tok.specials


def test_to_hf_with_a_char_tokenizer(tmp_path: Path, runner) -> None:
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(TRAIN_TEXT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
    RunDir(tmp_path / "run").save(model, tok, {})
    out = tmp_path / "hf"
    result = runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(out)])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr
    assert not (out / HF_VOCAB).exists() and (out / "tokenizer.json").exists()
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.is_fast and auto(TRAIN_TEXT[:300])["input_ids"] == tok.encode(TRAIN_TEXT[:300])
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    theirs, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert_same_model(model, theirs, tok.vocab_size)

    assert "not empty" in one_line_error(
        runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(out)])
    )
    result = runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(out), "--overwrite"])
    assert result.exit_code == 0, result.output


def test_to_hf_refuses_a_biasless_model(tmp_path: Path, runner) -> None:
    tok = CharTokenizer.from_text("abc")
    RunDir(tmp_path / "run").save(
        GPT(GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8, bias=False)),
        tok,
        {},
    )
    line = one_line_error(
        runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    )
    assert "no biases" in line and "--no-bias" in line
    assert not (tmp_path / "hf").exists()
    line = one_line_error(
        runner.invoke(app, ["convert", "to-hf", str(tmp_path / "nope"), str(tmp_path / "hf")])
    )
    assert "does not exist" in line


# ---------------------------------------------------------------- tokenizer files


def test_vocab_merges_round_trip(tiny_tok: TiktokenTokenizer) -> None:
    vocab, merges = bpe_vocab_merges(tiny_tok.ranks, tiny_tok.specials)
    assert len(merges) == len(tiny_tok.ranks) - 256
    assert vocab["Ġ"] == tiny_tok.ranks[b" "] and vocab["<|endoftext|>"] == tiny_tok.eot_id
    pairs = [tuple(m.split(" ")) for m in merges]
    ranks, specials = ranks_from_vocab_merges(vocab, pairs, Path("vocab.json"))
    assert ranks == tiny_tok.ranks and specials == tiny_tok.specials
    swapped = [pairs[1], pairs[0], *pairs[2:]]
    if vocab["".join(pairs[0])] != vocab["".join(pairs[1])]:
        with pytest.raises(Exception, match="out of id order"):
            ranks_from_vocab_merges(vocab, swapped, Path("vocab.json"))


@pytest.fixture(scope="module")
def r50k_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TiktokenTokenizer]:
    """A tiny model with GPT-2's tokenizer, exported by to-hf."""
    from typer.testing import CliRunner

    if not R50K_FILE.is_file():
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    r50k_file = R50K_FILE
    tmp = tmp_path_factory.mktemp("r50k")
    tok = TiktokenTokenizer.from_file(r50k_file)
    assert tok.name == "r50k_base"
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=8))
    RunDir(tmp / "run").save(model, tok, {})
    result = CliRunner().invoke(app, ["convert", "to-hf", str(tmp / "run"), str(tmp / "hf")])
    assert result.exit_code == 0, result.output
    return tmp / "hf", tok


@pytest.mark.slow
def test_r50k_tokenizer_files_match_tiktoken(r50k_export: tuple[Path, TiktokenTokenizer]) -> None:
    out, tok = r50k_export
    assert (out / HF_MERGES).read_text().splitlines()[:3] == ["#version: 0.2", "Ġ t", "Ġ a"]  # GPT-2's
    hf_tok = GPT2Tokenizer.from_pretrained(out)
    assert hf_tok("Hello world")["input_ids"] == [15496, 995] == tok.encode("Hello world")
    for text in (SAMPLE, TRAIN_TEXT, " Hello world", "<|end don't"):
        assert hf_tok(text)["input_ids"] == tok.encode(text), text
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == 50256


@pytest.mark.slow
def test_from_hf_finds_gpt2_tokenizer(
    r50k_export: tuple[Path, TiktokenTokenizer], r50k_file: Path, tmp_path: Path, runner, monkeypatch
) -> None:
    """r50k_base is recognised in a directory's vocab.json + merges.txt, else read from TIKTOKEN_CACHE_DIR."""
    exported, tok = r50k_export
    src = tmp_path / "hf"
    src.mkdir()
    for f in exported.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    result = runner.invoke(app, ["convert", "from-hf", str(src), str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "tokenizer tiktoken r50k_base (50,257 tokens)" in result.stderr
    assert RunDir(tmp_path / "a").tokenizer().to_json() == tok.to_json()

    for name in (HF_VOCAB, HF_MERGES):
        (src / name).unlink()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(r50k_file.parent))
    result = runner.invoke(app, ["convert", "from-hf", str(src), str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "tokenizer tiktoken r50k_base (50,257 tokens)" in result.stderr


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_every_run_survives_a_round_trip_through_hf(kind: str, tmp_path: Path, runner) -> None:
    """to-hf then from-hf gives back the same tokenizer and weights, for runs saved by minigpt 0.1 too."""
    run = tmp_path / "run"  # a copy: exporting notes the export in the run folder
    shutil.copytree(Path(__file__).parent / "fixtures" / f"run-v0.1-{kind}", run)
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert runner.invoke(app, ["convert", "to-hf", str(run), str(hf)]).exit_code == 0
    result = runner.invoke(app, ["convert", "from-hf", str(hf), str(back)])
    assert result.exit_code == 0, result.output
    ours, tok, _ = RunDir(run).load_model()
    again, tok2, _ = RunDir(back).load_model()
    assert tok2.to_json() == tok.to_json()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
