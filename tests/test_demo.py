"""The built-in demo: its corpus, and the whole train -> generate -> params run through the CLI."""

from __future__ import annotations

from pathlib import Path

from minigpt.cli.demo import demo_text, write_demo_text
from minigpt.cli.main import app
from minigpt.runs.folder import RunDir


def test_demo_corpus_is_real_text_and_written_once(tmp_path: Path) -> None:
    text = demo_text()
    assert len(text) > 100_000 and "for" in text and "\x00" not in text
    path = write_demo_text(tmp_path / "demo.txt")
    mtime = path.stat().st_mtime_ns
    assert write_demo_text(path).stat().st_mtime_ns == mtime
    assert path.read_text(encoding="utf-8") == text


def test_demo_trains_generates_and_counts(runner, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = runner.invoke(
        app, ["demo", "--max-time", "3s", "--out", str(out), "--tokens", "20", "--seed", "1"]
    )
    assert result.exit_code == 0, result.output
    assert (out / RunDir.WEIGHTS).is_file()
    assert "1/3 training" in result.stderr and "2/3 generating" in result.stderr
    assert "Total (GPT-3 style)" in result.stdout and "✓ matches" in result.stdout
    assert "tokens/s" in result.stderr and "trained on pydoc_topics.txt" in result.stdout
    assert "step" in result.stderr  # the training progress shows, as under `minigpt train`
