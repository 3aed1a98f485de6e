"""Every command keeps every option, default, panel and choice it had before its options were generated from
the configs: tests/fixtures/cli_options.json holds them as the hand-written CLI showed them (for the commands
moved last, also whether each is required, its bounds, its environment variable and its help)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer

from minigpt.cli.main import app

PINNED = Path(__file__).parent / "fixtures" / "cli_options.json"
_DEFAULT = re.compile(r"\\\[default: (.*)\]$")


def option_table(command: str) -> dict[str, dict[str, Any]]:
    """Every parameter of `minigpt COMMAND` ("convert from-hf" for a subcommand) by its first name: all its
    names, the default its help states, its help panel and its choices; then whether it is required, its
    bounds, its environment variable and its help."""
    click_command = typer.main.get_command(app)
    for name in command.split():
        click_command = click_command.commands[name]  # type: ignore[attr-defined]
    table = {}
    for p in click_command.params:
        d = p.type_descriptor
        shown = _DEFAULT.search(p.help or "") if hasattr(p, "rich_help_panel") else None
        table[p.opts[0]] = {
            "names": [*p.opts, *p.secondary_opts],
            "default": shown.group(1) if shown else None,
            "panel": getattr(p, "rich_help_panel", None),
            "choices": sorted(str(getattr(c, "value", c)) for c in d.choices or ()) if d.is_choice else [],
            "required": p.required,
            "range": [p.min, p.max],
            "envvar": p.envvar,
            "help": _DEFAULT.sub("", getattr(p, "help", None) or "").rstrip(),
        }
    return table


def test_train_keeps_every_option_default_panel_and_choice() -> None:
    pinned, now = json.loads(PINNED.read_text())["train"], option_table("train")
    assert set(pinned) <= set(now)  # options may be added, none taken away
    for name, before in pinned.items():
        after = now[name]
        assert after["names"] == before["names"], name
        assert after["default"] == before["default"], name
        assert after["panel"] == before["panel"], name
        # a choice shown before is still offered; free text may have become a checked choice
        assert set(before["choices"]) <= set(after["choices"]), name


def test_params_keeps_every_option() -> None:
    pinned, now = json.loads(PINNED.read_text())["params"], option_table("params")
    assert set(pinned) <= set(now)
    assert all(now[name]["names"] == pinned[name]["names"] for name in pinned)


MOVED = ("eval", "attention", "runs", "convert from-hf", "convert to-hf", "convert to-gguf", "convert merge",
         "chat", "demo", "serve", "generate")  # fmt: skip


@pytest.mark.parametrize("command", MOVED)
def test_commands_moved_to_configs_keep_every_option_as_they_were(command: str) -> None:
    assert option_table(command) == json.loads(PINNED.read_text())[command]
