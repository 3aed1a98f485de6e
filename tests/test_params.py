"""Parameter accounting against published counts and against the instantiated module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli.main import app
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.params import count_params
from minigpt.model.presets import PRESETS, preset

GPT3_175B = {
    "Embedding": 617_558_016,
    "Key": 14_495_514_624,
    "Query": 14_495_514_624,
    "Value": 14_495_514_624,
    "Output": 14_495_514_624,
    "Up-projection": 57_982_058_496,
    "Down-projection": 57_982_058_496,
    "Unembedding": 617_558_016,
}


def test_gpt3_175b_breakdown() -> None:
    report = count_params(GPTConfig(**preset("gpt3-175b")))
    assert {r.name: r.count for r in report.rows} == GPT3_175B
    assert report.gpt3_total == 175_181_291_520


@pytest.mark.parametrize(
    "name, total",
    # published sizes of the released GPT-2 checkpoints (tied head, biases, learned positions)
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_gpt2_exact_totals(name: str, total: int) -> None:
    assert count_params(GPTConfig(**preset(name))).exact_total == total


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 8, 11, 4), (2, 4, 32, 65, 16), (3, 2, 24, 300, 7)])
def test_exact_total_equals_module(shape: tuple[int, ...], bias: bool, tied: bool) -> None:
    L, H, D, V, T = shape
    config = GPTConfig(
        n_layer=L, n_head=H, n_embd=D, vocab_size=V, block_size=T, bias=bias, tie_embeddings=tied
    )
    report = count_params(config)
    assert sum(r.count for r in report.rows) == report.gpt3_total
    assert report.gpt3_total + sum(r.count for r in report.adjustments) == report.exact_total
    assert sum(report.shares.values()) == report.exact_total
    assert GPT(config).num_params() == report.exact_total


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith(("gpt2", "gpt3"))])
def test_presets_match_meta_module(name: str) -> None:
    """Count every published size on the meta device (no memory) and compare."""
    config = GPTConfig(**preset(name))
    if config.n_layer * config.n_embd > 24 * 2560:  # the largest take seconds even on meta
        config = GPTConfig(**{**config.to_dict(), "n_layer": 2})
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_params() == count_params(config).exact_total


def test_params_cli_table_and_json(runner) -> None:
    result = runner.invoke(app, ["params", "--preset", "gpt3-175b"])
    assert result.exit_code == 0, result.output
    for n in GPT3_175B.values():
        assert f"{n:,}" in result.output
    assert "175,181,291,520" in result.output
    result = runner.invoke(app, ["params", "--preset", "gpt2", "--json"])
    data = json.loads(result.output)
    assert data["exact_total"] == 124_439_808 and data["gpt3_total"] == sum(
        r["count"] for r in data["breakdown"]
    )


def test_params_cli_custom_shape_matches_preset(runner) -> None:
    a = runner.invoke(app, ["params", "--preset", "gpt2", "--json"])
    b = runner.invoke(
        app,
        [
            "params",
            "--n-layer",
            "12",
            "--n-head",
            "12",
            "--n-embd",
            "768",
            "--vocab-size",
            "50257",
            "--block-size",
            "1024",
            "--json",
        ],
    )
    assert json.loads(a.output)["exact_total"] == json.loads(b.output)["exact_total"]
    c = runner.invoke(app, ["params", "--preset", "gpt2", "--untied", "--no-bias", "--json"])
    assert json.loads(c.output)["config"]["bias"] is False


@pytest.mark.parametrize(
    "args",
    [
        ["--n-embd", "100", "--n-head", "3"],
        ["--n-layer", "0"],
        ["--preset", "gpt5"],
        ["--vocab-size", "-1"],
        ["no/such/run"],
    ],
)
def test_params_cli_bad_input_is_one_line(runner, args: list[str]) -> None:
    result = runner.invoke(app, ["params", *args])
    assert result.exit_code in (1, 2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_cli_subprocess_help_version_and_no_torch_import() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minigpt", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout == "minigpt 0.2.0\n"
    code = "import sys, minigpt.cli.main; assert 'torch' not in sys.modules, 'cli imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run(
        [sys.executable, "cli.py", "params", "--preset", "tiny", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(__import__("conftest").ROOT),
    )
    assert json.loads(out.stdout)["config"]["n_layer"] == 2


def test_params_without_arguments_reads_the_newest_run(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run and no shape: the newest run under checkpoints/ (as generate picks it), never a made-up shape;
    with no run there, a one-line error saying what to pass."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["params"])
    assert result.exit_code == 1 and result.output.startswith("error: no trained model under checkpoints")
    fixture = Path(__file__).parent / "fixtures" / "run-v0.1-char"
    shutil.copytree(fixture, tmp_path / "checkpoints" / "old")
    result = runner.invoke(app, ["params", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["name"] == str(Path("checkpoints") / "old")
    assert report["config"]["vocab_size"] == 42
    assert report["stored_total"] == report["exact_total"]
