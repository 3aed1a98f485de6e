"""Attention patterns: the explicit probabilities against SDPA and the model's logits, labels, and the CLI views."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from minigpt.analysis.attention import (
    attention_maps,
    attention_row,
    explain_last,
    resolve_index,
    token_label,
    token_labels,
    top_attended,
)
from minigpt.analysis.attention_views import format_explain
from minigpt.cli.main import app
from minigpt.errors import UsageError
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT, attend, block, linear, norm, qkv
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.base import Tokenizer
from minigpt.tokenizer.char import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello world,\nhow are you?\tFine. café ☃ 中文 – ok\n"


class ByteTokenizer(Tokenizer):
    """A byte-level stand-in for BPE: one id per byte, so multi-byte characters split across tokens."""

    kind = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(ids)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind}


def tiny_model(vocab_size: int, block_size: int = 64, seed: int = 0, **kw: Any) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(
        **{"vocab_size": vocab_size, "block_size": block_size, "n_layer": 2, "n_head": 4, "n_embd": 32, **kw}
    )
    model = GPT(config).eval()
    with torch.no_grad():  # sharper patterns than the near-uniform ones of a fresh init
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(10)
    return model


@pytest.fixture
def char_run(tmp_path: Path) -> Path:
    tok = CharTokenizer.from_text(TEXT)
    RunDir(tmp_path / "run").save(tiny_model(tok.vocab_size, block_size=48), tok, extra={})
    return tmp_path / "run"


# --------------------------------------------------------------------------- the weights


@pytest.mark.parametrize("bias", [True, False])
def test_patterns_are_causal_distributions(bias: bool) -> None:
    model = tiny_model(50, bias=bias)
    ids = torch.randint(0, 50, (20,)).tolist()
    w = attention_maps(model, ids).weights
    assert w.shape == (2, 4, 20, 20)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 20))
    assert torch.all(w.triu(diagonal=1) == 0)
    assert torch.all(w >= 0)
    assert torch.all(w[:, :, 0, 0] == 1)


@pytest.mark.parametrize("bias", [True, False])
def test_weights_times_values_reproduce_sdpa_output(bias: bool) -> None:
    """The shown weights @ V through c_proj equal what each layer's fused attention (SDPA) gives in forward."""
    model = tiny_model(50, bias=bias)
    ids = torch.randint(0, 50, (24,)).tolist()
    weights = attention_maps(model, ids).weights
    w = model.weights()
    with torch.no_grad():
        x = F.embedding(torch.tensor([ids]), w.wte) + w.wpe[:24]
        for i, b in enumerate(w.h):
            inputs = norm(b.ln_1, x)
            _, _, v = qkv(b.attn, inputs)
            y = (weights[i].unsqueeze(0) @ v).transpose(1, 2).reshape(1, 24, 32)
            torch.testing.assert_close(
                linear(b.attn.c_proj, y), attend(b.attn, inputs, i), atol=1e-5, rtol=1e-4
            )
            x = block(b, x, i)


def test_maps_reproduce_logits_and_leave_the_model_alone() -> None:
    model = tiny_model(50, dropout=0.3)
    ids = torch.randint(0, 50, (30,)).tolist()
    with torch.no_grad():
        ref, _ = model(torch.tensor([ids]), all_logits=True)
    model.train()  # dropout on: the maps must still be deterministic inference
    maps = attention_maps(model, ids)
    assert model.training
    torch.testing.assert_close(maps.logits, ref[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(attention_maps(model, ids).weights, maps.weights)


def test_attention_row_is_the_last_row_and_ignores_later_tokens() -> None:
    model = tiny_model(50)
    ids = torch.randint(0, 50, (16,)).tolist()
    full = attention_maps(model, ids).weights
    for p in (0, 5, 15, -1, -16):
        q = p % 16
        torch.testing.assert_close(attention_row(model, ids, p), full[:, :, q, : q + 1])
    changed = ids[:6] + [(t + 1) % 50 for t in ids[6:]]
    torch.testing.assert_close(attention_row(model, changed, 5), full[:, :, 5, :6])


def test_too_long_or_empty_is_a_usage_error() -> None:
    model = tiny_model(50, block_size=8)
    with pytest.raises(UsageError, match="block_size 8"):
        attention_maps(model, list(range(9)))
    with pytest.raises(UsageError, match="no tokens"):
        attention_maps(model, [])


def test_top_attended_orders_by_weight_then_position() -> None:
    row = torch.tensor([0.1, 0.4, 0.1, 0.4])
    assert top_attended(row, 3) == [(1, pytest.approx(0.4)), (3, pytest.approx(0.4)), (0, pytest.approx(0.1))]
    assert len(top_attended(row, 10)) == 4


def test_resolve_index() -> None:
    assert resolve_index(0, 5, "layer", "layers") == 0
    assert resolve_index(-1, 5, "layer", "layers") == 4
    assert resolve_index(-5, 5, "layer", "layers") == 0
    for bad in (5, -6, 100):
        with pytest.raises(UsageError, match=rf"layer {bad} is out of range: there are 5 layers \(use 0..4"):
            resolve_index(bad, 5, "layer", "layers")


# --------------------------------------------------------------------------- labels


@pytest.mark.parametrize(
    ("data", "label"),
    [
        (b"a", "a"),
        (b"\n", "⏎"),
        (b"\t", "⇥"),
        (b" the", "·the"),
        (b"\r\n", "␍⏎"),
        ("é".encode(), "é"),
        ("中".encode(), "中"),
        ("é".encode()[:1], "\\xc3"),
        ("中".encode()[1:], "\\xb8\\xad"),
        (b"\\x41", "\\\\x41"),  # a literal backslash is doubled, so it cannot pass for a byte escape
        (b"\x00\x1b", "\\x00\\x1b"),
        ("\u200b".encode(), "\\u200b"),
        ("\u00a0".encode(), "\\u00a0"),
        ("\u0301".encode(), "◌\u0301"),
        (b"", "∅"),
    ],
)
def test_token_label(data: bytes, label: str) -> None:
    assert token_label(data) == label
    assert "\n" not in token_label(data)


def test_token_labels_decode_each_id_alone() -> None:
    assert token_labels(ByteTokenizer(), ByteTokenizer().encode("aé ☃")) == [
        "a", "\\xc3", "\\xa9", "·", "\\xe2", "\\x98", "\\x83",
    ]  # fmt: skip
    tok = CharTokenizer.from_text(TEXT)
    assert token_labels(tok, tok.encode("é\n中 ")) == ["é", "⏎", "中", "·"]


# --------------------------------------------------------------------------- explain_last (generate --explain)


def test_explain_last_matches_the_last_layer_row() -> None:
    model = tiny_model(256, block_size=16)
    tok = ByteTokenizer()
    ids = tok.encode("héllo, wörld")
    focus = explain_last(model, ids, tok, top=2)
    row = attention_row(model, ids)[-1]
    assert [f.head for f in focus] == [0, 1, 2, 3] and {f.layer for f in focus} == {1}
    for f in focus:
        assert [(a.position, a.weight) for a in f.top] == [
            (p, pytest.approx(w)) for p, w in top_attended(row[f.head], 2)
        ]
        for a in f.top:
            assert a.label == token_label(bytes([ids[a.position]]))
    line = format_explain(focus)
    assert "\n" not in line and line.startswith("L1 h0: ") and " │ h3: " in line
    a = focus[0].top[0]
    assert f"{a.label}@{a.position} {a.weight:.0%}" in line
    wrapped = format_explain(focus, width=60, indent=11)
    lines = wrapped.split("\n")
    assert len(lines) > 1 and all(11 + len(x.lstrip()) <= 60 for x in lines)
    assert [x.strip() for x in " │ ".join(x.strip() for x in lines).split(" │ ")] == line.split(" │ ")


def test_explain_last_crops_to_block_size_and_keeps_positions() -> None:
    model = tiny_model(256, block_size=8)
    ids = list(b"abcdefghijklmn")  # 14 tokens, 6 over
    focus = explain_last(model, ids, ByteTokenizer(), top=3)
    cropped = explain_last(model, ids[6:], ByteTokenizer(), top=3)
    for f, g in zip(focus, cropped, strict=True):
        assert [a.position for a in f.top] == [a.position + 6 for a in g.top]
        assert [a.label for a in f.top] == [a.label for a in g.top]
        assert all(6 <= a.position < 14 for a in f.top)
    with pytest.raises(UsageError):
        explain_last(model, ids, ByteTokenizer(), top=0)


# --------------------------------------------------------------------------- CLI


def _one_line_error(result: Any, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_position_view_char_model(runner: Any, char_run: Path) -> None:
    text = "Hello\nhow? café ☃ 中文"
    result = runner.invoke(app, ["attention", text, "--model", str(char_run)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "over positions 0..19" in out and "2 layers × 4 heads" in out
    for label in ("⏎", "é", "☃", "中", "文", "·"):
        assert label in out
    assert all(f"L{a} H{h}" in out for a in range(2) for h in range(4))
    assert "Top 3 attended tokens per head" in out


def test_cli_json_matches_library(runner: Any, char_run: Path) -> None:

    text = "café\n☃ 中文"
    result = runner.invoke(app, ["attention", text, "--model", str(char_run), "--json", "--position", "-2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    model, tok, _ = RunDir(char_run).load_model()
    ids = tok.encode(text)
    assert data["ids"] == ids[:-1] and data["tokens"] == list(text[:-1]) and data["position"] == len(ids) - 2
    assert (data["n_layer"], data["n_head"], data["dropped"]) == (2, 4, 0)
    w = torch.tensor(data["weights"])
    assert w.shape == (2, 4, len(ids) - 1)
    torch.testing.assert_close(w, attention_row(model, ids, -2), atol=1e-6, rtol=0)


def test_cli_grid_view_and_json(runner: Any, char_run: Path) -> None:
    text = "ae\nwd é中"
    result = runner.invoke(app, ["attention", text, "--model", str(char_run), "--layer", "1", "--head", "-1"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "Layer 1, head 3" in lines[0]
    rows = [line for line in lines if line[:2].strip().isdigit()]
    assert len(rows) == len(text)
    assert rows[2].split()[:2] == ["2", "⏎"] and rows[6].split()[:2] == ["6", "é"]
    # causal: the row of position q ends with q+1 cells (one or two characters wide), nothing after them
    for q, row in enumerate(rows):
        drawn = len(row.rstrip()) - len(row.rstrip().rstrip("·░▒▓█"))
        assert drawn in (q + 1, 2 * (q + 1)), row
    assert "blank: future tokens, masked" in result.stdout

    result = runner.invoke(
        app, ["attention", text, "--model", str(char_run), "--layer", "1", "--head", "3", "--json"]
    )
    data = json.loads(result.stdout)
    w = torch.tensor(data["weights"])
    assert (data["layer"], data["head"]) == (1, 3) and w.shape == (len(text), len(text))
    torch.testing.assert_close(w.sum(-1), torch.ones(len(text)), atol=1e-5, rtol=0)
    assert torch.all(w.triu(diagonal=1) == 0)

    result = runner.invoke(app, ["attention", text, "--model", str(char_run), "--layer", "0", "--json"])
    assert torch.tensor(json.loads(result.stdout)["weights"]).shape == (4, len(text), len(text))
    result = runner.invoke(app, ["attention", text, "--model", str(char_run), "--layer", "0"])
    assert all(f"Layer 0, head {h}" in result.stdout for h in range(4))


def test_cli_byte_level_tokenizer(runner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer whose tokens split multi-byte characters: labels show the pieces as \\xNN."""
    model = tiny_model(256, block_size=32)
    monkeypatch.setattr(RunDir, "load_model", lambda self, device="cpu": (model, ByteTokenizer(), {}))
    text = "né\n☃!"
    result = runner.invoke(app, ["attention", text, "--model", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for label in ("\\xc3", "\\xa9", "⏎", "\\xe2", "\\x98", "\\x83"):
        assert label in result.stdout
    result = runner.invoke(app, ["attention", text, "--model", str(tmp_path), "--layer", "0", "--head", "0"])
    assert result.exit_code == 0 and "\\" in result.stdout
    data = json.loads(runner.invoke(app, ["attention", text, "--model", str(tmp_path), "--json"]).stdout)
    assert data["tokens"] == ["n", "\\xc3", "\\xa9", "\n", "\\xe2", "\\x98", "\\x83", "!"]
    assert len(data["weights"][0][0]) == len(text.encode())


@pytest.mark.slow
def test_cli_long_text_keeps_last_block(runner: Any, tmp_path: Path) -> None:
    tok = CharTokenizer.from_text("abcdefgh \n")
    RunDir(tmp_path / "run").save(tiny_model(tok.vocab_size, block_size=80), tok, extra={})
    text = "abc defgh\n" * 10  # 100 characters
    result = runner.invoke(app, ["attention", text, "--model", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    assert "keeping the last 80" in result.stderr
    data = json.loads(result.stdout)
    assert data["dropped"] == 20 and data["ids"] == tok.encode(text[20:])
    # the terminal views show the last 64 positions and say so
    result = runner.invoke(app, ["attention", text, "--model", str(tmp_path / "run")])
    assert result.exit_code == 0 and "showing the last 64 of 80 positions" in result.stderr
    assert "earlier" in result.stdout and " 79" in result.stdout
    result = runner.invoke(
        app, ["attention", text, "--model", str(tmp_path / "run"), "--layer", "0", "--head", "0"]
    )
    rows = [line for line in result.stdout.splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 64 and rows[0].split()[0] == "16" and rows[-1].split()[0] == "79"


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["--layer", "2"], 2, ("layer 2 is out of range", "2 layers")),
        (["--layer", "-3"], 2, ("layer -3",)),
        (["--layer", "0", "--head", "4"], 2, ("head 4 is out of range", "4 heads")),
        (["--position", "5"], 2, ("position 5 is out of range", "5 tokens")),
        (["--position", "-6"], 2, ("position -6",)),
        (["--head", "0"], 2, ("--head needs --layer",)),
    ],
)
def test_cli_bad_indices_are_one_line_errors(
    runner: Any, char_run: Path, args: list[str], code: int, needles: tuple[str, ...]
) -> None:
    _one_line_error(
        runner.invoke(app, ["attention", "Hello", "--model", str(char_run), *args]), code, *needles
    )


def test_cli_bad_text_and_model(
    runner: Any, char_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _one_line_error(runner.invoke(app, ["attention", "", "--model", str(char_run)]), 2, "TEXT is empty")
    _one_line_error(runner.invoke(app, ["attention", "Hello 🙂", "--model", str(char_run)]), 1, "'🙂'")
    _one_line_error(
        runner.invoke(app, ["attention", "Hi", "--model", str(tmp_path / "nope")]), 1, "does not exist"
    )
    monkeypatch.chdir(tmp_path)
    _one_line_error(runner.invoke(app, ["attention", "Hi"]), 1, "no trained model")


def test_cli_default_model_is_the_latest_run(
    runner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = CharTokenizer.from_text(TEXT)
    RunDir(tmp_path / "checkpoints" / "a").save(tiny_model(tok.vocab_size), tok, extra={})
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["attention", "Hello", "--json"])
    assert result.exit_code == 0, result.output
    assert "using checkpoints/a" in result.stderr and json.loads(result.stdout)["model"] == "checkpoints/a"


def test_cli_png(runner: Any, char_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    one, tile = tmp_path / "one.png", tmp_path / "tile.png"
    result = runner.invoke(app, ["attention", "Hello\né", "--model", str(char_run), "--layer", "0", "--head", "1",
                                 "--png", str(one)])  # fmt: skip
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["attention", "Hello\né", "--model", str(char_run), "--png", str(tile), "--json"]
    )
    assert result.exit_code == 0, result.output
    with Image.open(one) as a, Image.open(tile) as b:
        assert a.format == b.format == "PNG"
        assert b.width > a.width / 2 and b.height > 100
    result = runner.invoke(
        app, ["attention", "Hi", "--model", str(char_run), "--png", str(tmp_path / "no" / "x.png")]
    )
    _one_line_error(result, 1, "does not exist")


def test_cli_png_without_pillow_names_the_extra(runner: Any, char_run: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` fail as if it were not installed
    result = runner.invoke(
        app, ["attention", "Hi", "--model", str(char_run), "--png", str(tmp_path / "x.png")]
    )
    _one_line_error(result, 1, "pip install 'minigpt[viz]'")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_subprocess_attention_json(char_run: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minigpt", "attention", "Hi\nhow", "--model", str(char_run), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tokens"] == list("Hi\nhow") and len(data["weights"]) == 2


def test_the_views_show_what_a_local_layer_cannot_see(runner: Any, tmp_path: Path) -> None:
    """A layer with a window of 4 puts zero weight before it; the views mark those positions with "-"
    and the JSON lists every layer's window."""
    tok = CharTokenizer.from_text(TEXT)
    model = tiny_model(tok.vocab_size, block_size=48, n_layer=3, window=4, window_pattern="SL", pos="rope")
    RunDir(tmp_path / "run").save(model, tok, extra={})
    text, run = "how are you? Fine world", str(tmp_path / "run")
    data = json.loads(runner.invoke(app, ["attention", text, "--model", run, "--json"]).stdout)
    assert data["windows"] == [4, 48, 48]
    w = torch.tensor(data["weights"])
    assert w[0, :, : len(text) - 4].abs().max() == 0 and w[0, :, -4:].sum(-1).allclose(torch.ones(4))
    out = runner.invoke(app, ["attention", text, "--model", run]).stdout
    assert "layer 0 sees only its window, the last 4 tokens" in out
    rows = [line.split()[2:] for line in out.splitlines() if line.startswith("L0 H0") and "@" not in line]
    cells = [cell for row in rows for cell in row]  # the row, over tables that each fit the width
    assert cells[: len(text) - 4] == ["-"] * (len(text) - 4) and "-" not in cells[-4:]
    grid = runner.invoke(app, ["attention", text, "--model", run, "--layer", "0", "--head", "0"]).stdout
    words = " ".join(grid.split())  # rich wraps the title and legend at the terminal's width
    assert "each position sees the last 4 (its window)" in words and "-: before the window" in words
    last_row = [line for line in grid.splitlines() if line.split()[:1] == [str(len(text) - 1)]][0]
    assert last_row.count("-") >= 2 * (len(text) - 4)  # two characters a cell
