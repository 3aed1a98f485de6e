"""`minigpt runs`: what runs exist, newest first; `params RUN` says how the run was trained."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.cli.main import app
from minigpt.runs.folder import RunDir

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Two runs (the char one written last) and a folder with a damaged config.json."""
    for name, kind, when in (("older", "bpe", 1_000_000), ("newer", "char", 2_000_000)):
        shutil.copytree(FIXTURES / f"run-v0.1-{kind}", tmp_path / name)
        for f in (tmp_path / name).iterdir():
            os.utime(f, (when, when))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / RunDir.CONFIG).write_text("{")
    (tmp_path / "not-a-run").mkdir()
    return tmp_path


def test_runs_lists_newest_first_as_json(runner, root: Path) -> None:
    result = runner.invoke(app, ["runs", str(root), "--json"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)
    assert [Path(r["path"]).name for r in runs] == ["newer", "older"]
    newer = runs[0]
    assert newer["tokenizer"] == "char (42)" and newer["shape"] == "2x2x32, ctx 32"
    assert newer["steps"] == 60 and newer["tokens"] == 30720 and newer["data"] == "corpus.txt"
    assert newer["params"] == 27840 and newer["best_val_loss"] == pytest.approx(1.7016, abs=1e-4)
    assert "warning: skipped" in result.stderr and "broken" in result.stderr


def test_runs_table_and_empty_folder(runner, root: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["runs", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    lines = [line for line in result.stdout.splitlines() if "corpus.txt" in line]
    assert len(lines) == 2 and "newer" in lines[0] and "1.7016" in lines[0]
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["runs", str(tmp_path / "empty")])
    assert result.exit_code == 0 and "no runs under" in result.stderr
    result = runner.invoke(app, ["runs", str(tmp_path / "missing")])
    assert result.exit_code == 1 and result.output.startswith("error:")


def test_newest_run_is_the_one_that_changed_last(root: Path) -> None:
    """Not the newest weights file: a resumed run rewrites config.json at each evaluation."""
    shutil.rmtree(root / "broken")
    assert RunDir.latest(root).path.name == "newer"
    os.utime(root / "older" / RunDir.CONFIG, (3_000_000, 3_000_000))
    assert RunDir.latest(root).path.name == "older"


def test_params_of_a_run_says_how_it_was_trained(runner, root: Path) -> None:
    result = runner.invoke(app, ["params", str(root / "newer")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "trained on corpus.txt, tokenizer char (42): 60 steps, 30,720 tokens" in result.stdout
    assert "lr=0.008 schedule=wsd" in result.stdout
    data = json.loads(runner.invoke(app, ["params", str(root / "newer"), "--json"]).stdout)
    assert data["run"]["steps"] == 60 and data["stored_total"] == data["exact_total"]


def _in_terminal(args: list[str], cwd: Path, columns: int) -> str:
    """`minigpt ARGS` with its stdout on a pseudo-terminal `columns` wide (what a user's terminal is), its
    output without colours."""
    fcntl, pty, struct, termios = (pytest.importorskip(m) for m in ("fcntl", "pty", "struct", "termios"))
    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "minigpt", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=writer, stderr=subprocess.PIPE)  # fmt: skip
    os.close(writer)
    out = b""
    while True:
        try:
            chunk = os.read(reader, 1 << 16)
        except OSError:  # Linux: the other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(reader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()  # type: ignore[union-attr]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode()).replace("\r\n", "\n")


@pytest.fixture
def project(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose checkpoints/ holds the two runs, one with a long name: runs are named from here."""
    where = tmp_path_factory.mktemp("project")
    (where / "checkpoints").mkdir()
    for name, new in (("older", "older"), ("newer", "shakespeare-char-6-layers")):
        shutil.copytree(root / name, where / "checkpoints" / new)
    return where


@pytest.mark.slow
def test_runs_fits_an_80_column_terminal_with_every_path_whole(project: Path) -> None:
    out = _in_terminal(["runs"], project, 80)
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    assert "…" not in out
    for name in ("checkpoints/older", "checkpoints/shakespeare-char-6-layers"):
        row = next(line for line in lines if name in line)  # the whole path, on one line
        assert re.search(r"\d\.\d{4}", row) and " ago" in row, row  # with its best loss and age
    assert "left out at this width:" in out and "--json has every field" in out
    wide = _in_terminal(["runs"], project, 200)
    assert "left out" not in wide and "2x2x32, ctx 32" in wide


def test_runs_piped_prints_every_column_whole(runner, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped, rich would take 80 columns and cut every cell: the table takes the width its values need."""
    monkeypatch.chdir(project)
    result = runner.invoke(app, ["runs"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout and "left out" not in result.stdout
    row = next(line for line in result.stdout.splitlines() if "checkpoints/shakespeare-char-6-layers" in line)
    for value in ("corpus.txt", "char (42)", "2x2x32, ctx 32", "27.84k", "30.72k", "1.7016", "2.455", " ago"):
        assert value in row, (value, row)


def test_params_and_eval_piped_keep_every_cell_whole(runner, root: Path) -> None:
    result = runner.invoke(
        app, ["params", "--preset", "gpt3-175b", "--arch", "modern"], env={"COLUMNS": "60"}
    )
    assert result.exit_code == 0 and "…" not in result.stdout
    lines = result.stdout.splitlines()
    assert any("Key" in line and "128 × 12,288 × 96 heads × 96 layers" in line for line in lines), (
        result.stdout
    )
    assert any(line.startswith("flops: forward = ") and "(lookups)" in line for line in lines)
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    result = runner.invoke(app, ["eval", str(root / "older"), str(text)], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "loss (nats/token)" in line)
    assert "perplexity" in header and "bits per byte" in header


def test_params_in_a_narrow_terminal_wraps_cells_and_never_cuts_them() -> None:
    import io

    from rich.console import Console

    from minigpt.cli.views import print_params
    from minigpt.model.params import count_params
    from minigpt.model.presets import model_config

    console = Console(file=io.StringIO(), width=50, force_terminal=True, color_system=None)
    print_params(count_params(model_config("gpt3-175b", "gpt2")), "gpt3-175b", console=console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in out and all(len(line) <= 50 for line in out.splitlines())
    assert "175,181,291,520" in out  # numbers are never folded
