"""The built-in demo: its corpus, and the whole train -> generate -> params run through the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_cli_hints import assert_hints_exist

from minigpt.cli.demo import demo_text, write_demo_text
from minigpt.cli.main import app
from minigpt.runs.folder import RunDir

FIXTURES = Path(__file__).parent / "fixtures"


def test_demo_corpus_is_real_text_and_written_once(tmp_path: Path) -> None:
    text = demo_text()
    assert len(text) > 100_000 and "for" in text and "\x00" not in text
    path = write_demo_text(tmp_path / "demo.txt")
    mtime = path.stat().st_mtime_ns
    assert write_demo_text(path).stat().st_mtime_ns == mtime
    assert path.read_text(encoding="utf-8") == text


def _user_run(out: Path) -> dict[str, bytes]:
    """A run of the user's at `out` (the fixtures' char run), and its files' bytes."""
    shutil.copytree(FIXTURES / "run-v0.1-char", out)
    return {f.name: f.read_bytes() for f in out.iterdir()}


def test_demo_refuses_a_folder_that_holds_a_run(runner, tmp_path: Path) -> None:
    """The demo never replaces a run unasked, whoever made it; the error names the demo's own options."""
    out = tmp_path / "demo"
    before = _user_run(out)
    result = runner.invoke(app, ["demo", "--max-time", "3s", "--out", str(out)], prog_name="minigpt")
    assert result.exit_code == 1 and result.stdout == ""
    assert (
        result.stderr
        == f"error: {out} already holds a run: pass --out DIR for a new one, or --overwrite to replace it\n"
    )
    assert_hints_exist(result.stderr, ["demo"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


@pytest.mark.slow
def test_demo_trains_generates_and_counts(runner, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    before = _user_run(out)
    args = ["demo", "--max-time", "3s", "--out", str(out), "--tokens", "20", "--seed", "1", "--overwrite"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / RunDir.WEIGHTS).read_bytes() != before[RunDir.WEIGHTS]  # replaced, as asked
    assert "1/3 training" in result.stderr and "2/3 generating" in result.stderr
    assert "Total (GPT-3 style)" in result.stdout and "✓ matches" in result.stdout
    assert "tokens/s" in result.stderr and "trained on pydoc_topics.txt" in result.stdout
    assert "step" in result.stderr  # the training progress shows, as under `minigpt train`
