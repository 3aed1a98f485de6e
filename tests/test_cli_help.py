"""What `--help` says: it agrees with what the code does, shows on/off flags as flags, and the top-level help
lists the commands in the order a new user meets them."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

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


def _commands(group=None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the CLI: ("train",), ("convert", "to-gguf"), ..."""
    group = group or typer.main.get_command(app)
    found = []
    for name, command in group.commands.items():
        found += _commands(command, (*path, name)) if hasattr(command, "commands") else [(*path, name)]
    return found


@pytest.mark.parametrize("command", [(), ("convert",), *_commands()], ids=" ".join)
def test_on_off_flags_show_no_value(runner, command: tuple[str, ...]) -> None:
    """typer shows a flag as `--json <bool>`, as if `--json true` were valid: flags show no value type."""
    text = _help(runner, *command)
    assert "--help -h Show this message" in text
    assert "<bool>" not in text


def test_top_level_help_starts_with_the_demo_and_lists_commands_in_workflow_order(runner) -> None:
    result = runner.invoke(app, ["--help"], prog_name="minigpt", env={"COLUMNS": "250"})
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "─ Commands ─" in line)
    rows = [line.split()[1] for line in lines[start + 1 :] if line.startswith("│ ")]
    assert rows == ["demo", "train", "generate", "chat", "params", "eval", "attention", "prepare", "runs",
                    "convert", "serve"]  # fmt: skip
    text = " ".join(result.stdout.split())
    assert "Start here: minigpt demo" in text and 'minigpt generate "TEXT"' in text
    serve = next(line for line in lines if line.startswith("│ serve"))
    assert "/v1/completions" in serve and "/v1/chat/completions" in serve
