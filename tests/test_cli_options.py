"""Every command keeps every option, default, panel and choice it had before its options were generated from
the configs: tests/fixtures/cli_options.json holds them as the hand-written CLI showed them (for the commands
moved last, also whether each is required, its bounds, its environment variable and its help). Every other
command and subcommand (`minigpt` itself, train, params, prepare and convert's group) is pinned as the code
showed it at f961398, the last commit before the move into packages: names, stated default, panel, choices,
whether it is required, bounds and environment variable."""

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
ROOT = "minigpt"


def option_table(command: str) -> dict[str, dict[str, Any]]:
    """Every parameter of `minigpt COMMAND` ("convert from-hf" for a subcommand, "minigpt" for the program's
    own) by its first name: all its names, the default its help states, its help panel and its choices; then
    whether it is required, its bounds, its environment variable and its help."""
    click_command = typer.main.get_command(app)
    for name in [] if command == ROOT else command.split():
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


MOVED = ("eval", "attention", "runs", "convert from-hf", "convert to-hf", "convert to-gguf", "convert merge",
         "chat", "demo", "serve", "generate")  # fmt: skip


@pytest.mark.parametrize("command", MOVED)
def test_commands_moved_to_configs_keep_every_option_as_they_were(command: str) -> None:
    assert option_table(command) == json.loads(PINNED.read_text())[command]


PINNED_AT_MOVE = (ROOT, "train", "params", "prepare", "convert")


@pytest.mark.parametrize("command", PINNED_AT_MOVE)
def test_other_commands_keep_every_option_as_they_were_before_the_move(command: str) -> None:
    pinned, now = json.loads(PINNED.read_text())[command], option_table(command)
    assert set(pinned) <= set(now)  # options may be added, none taken away
    for name, before in pinned.items():
        assert {field: now[name][field] for field in before} == before, name


def commands(group: Any, path: str = ROOT) -> list[str]:
    """`path` and every command and subcommand under it, as option_table names them."""
    under = "" if path == ROOT else f"{path} "
    found = [path]
    for name, sub in getattr(group, "commands", {}).items():
        found += commands(sub, under + name)
    return found


def test_every_command_and_subcommand_is_pinned() -> None:
    app_commands = set(commands(typer.main.get_command(app)))
    # a new command is pinned in the commit that adds it
    assert app_commands == set(json.loads(PINNED.read_text())) == {*MOVED, *PINNED_AT_MOVE}
