"""An error that recommends an option names one the command has: the option is checked against the
command's own parameters (and a quoted `minigpt CMD ...` against CMD's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from minigpt.cli.main import app

_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_QUOTED = re.compile(r"`minigpt ([^`]*)`")


def _command(words: list[str]) -> tuple[typer.core.TyperCommand, list[str]]:
    """The command `minigpt WORDS...` runs and the words after its name."""
    command = typer.main.get_command(app)
    while words and hasattr(command, "commands") and words[0] in command.commands:
        command, words = command.commands[words[0]], words[1:]
    assert not hasattr(command, "commands"), f"no command in {words}"
    return command, words


def _names(command: typer.core.TyperCommand) -> set[str]:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts)}


def assert_hints_exist(message: str, words: list[str]) -> None:
    """Every option `message` names exists on the command `minigpt WORDS` ran, or on the one a quoted
    `minigpt CMD ...` in it names; a quoted command's placeholders (RUN, FILE) are arguments it takes."""
    for quoted in _QUOTED.findall(message):
        command, rest = _command(quoted.split())
        assert set(_OPTION.findall(quoted)) <= _names(command), (quoted, message)
        placeholders = [w for w in rest if w.isupper()]
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        assert len(placeholders) <= len(arguments), (quoted, message)
    command, _ = _command(words)
    named = set(_OPTION.findall(_QUOTED.sub("", message)))
    assert named <= _names(command), f"{message!r} names {sorted(named - _names(command))}"


def test_the_checker_catches_an_option_the_command_lacks() -> None:
    with pytest.raises(AssertionError):
        assert_hints_exist("no trained model: pass --model DIR", ["chat"])
    with pytest.raises(AssertionError):
        assert_hints_exist("run `minigpt params --top 3` instead", ["generate"])
    assert_hints_exist("pass --model DIR, or `minigpt train FILE --max-time 5m`", ["generate"])


@pytest.mark.parametrize(
    "args", [["generate", "x"], ["attention", "x"], ["chat"], ["params"], ["serve"]], ids=lambda a: a[0]
)
def test_with_no_runs_each_command_says_how_it_takes_one(
    runner, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no checkpoints/ here
    result = runner.invoke(app, args, prog_name="minigpt", input="")
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert message.startswith("error: no trained model under checkpoints/") and "\n" not in message
    assert_hints_exist(message, args[:1])
