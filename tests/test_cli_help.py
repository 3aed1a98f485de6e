"""What `--help` says: it agrees with what the code does, shows on/off flags as flags, and the top-level help
lists the commands in the order a new user meets them."""

from __future__ import annotations

from pathlib import Path

from minigpt.cli.main import app
from minigpt.data.dataset import DataConfig, prepare_data


def _help(runner, *command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], prog_name="minigpt", env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def test_val_fraction_help_names_the_end_the_split_takes(runner, tmp_path: Path) -> None:
    first, last = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("abcd " * 400, encoding="utf-8")
    last.write_text("wxyz " * 400, encoding="utf-8")
    data = DataConfig(paths=(first, last), tokenizer="char", val_fraction=0.5, cache_dir=tmp_path / "cache")
    held_out = prepare_data(data, 8, progress=False)
    assert set(held_out.tokenizer.decode(held_out.val[:].tolist())) <= set("wxyz ")  # the corpus's end
    assert "whole documents from the end of the corpus" in _help(runner, "train")
