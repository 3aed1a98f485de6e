"""`minigpt runs`: what runs exist, newest first; `params RUN` says how the run was trained."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from minigpt.cli.main import app
from minigpt.runs.folder import RunDir

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
