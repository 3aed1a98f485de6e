"""The settings scheme on a config written here: a field with `setting(...)` is an option, with its help,
panel, choices, flags, parser and stated default, and the values given reach the config (nested ones in their
dict); nothing else has to be written for a new option."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from minigpt.cli.main import _Group
from minigpt.cli.typer_options import command_line, with_options
from minigpt.common.settings import (
    NO_OPTIONS,
    OPT,
    RUN,
    Given,
    check_bounds,
    check_choices,
    nested,
    options_of,
    setting,
)
from minigpt.errors import UsageError


def _count(text: str) -> int:
    """'3k' is 3000; a parser reads back what it gave (str(3000)), so a command line can be handed on."""
    digits = text.removesuffix("k")
    if not digits.isdigit():
        raise UsageError(f"cannot read {text!r}: give digits, k for thousands")
    return int(digits) * (1000 if text.endswith("k") else 1)


@dataclass(frozen=True)
class Inner:
    width: int = setting(8, "Width.", panel=OPT)
    shape: str = setting(
        "round",
        "Shape.",
        panel=OPT,
        choices=("round", "square"),
        by={"a": {"shape": "round"}, "b": {"shape": "square"}},
    )


@dataclass(frozen=True)
class Outer:
    rate: float = setting(0.004, "Rate.", panel=OPT)
    fast: bool = setting(False, "Go fast.", panel=RUN)
    tied: bool = setting(True, "Tie.", panel=RUN, flags=("--tie/--untie",))
    count: int | None = setting(None, "A count.", panel=RUN, parse=_count, metavar="<digits>")
    where: Path | None = setting(None, "A place.", panel=RUN, shown="here")
    inner: dict[str, Any] = nested(Inner)
    plain: int = 3  # no option

    def __post_init__(self) -> None:
        check_choices(self)


def _app(seen: dict[str, Any]) -> typer.Typer:
    app = typer.Typer(cls=_Group)  # minigpt's own one-line errors

    @app.command()
    @with_options(options_of(Outer))
    def run(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help="A name.")],
        given: Given = NO_OPTIONS,
        loud: Annotated[bool, typer.Option("--loud", help="Shout.")] = False,
    ) -> None:
        seen.update(name=name, loud=loud, config=Outer(**given.of(Outer)), flags=given.flags())
        seen["again"] = command_line(ctx)

    @app.command()
    def other() -> None:  # a second command, so `run` keeps its name
        pass

    return app


def test_every_field_with_a_setting_is_an_option_with_its_default_stated() -> None:
    options = {o.name: o for o in options_of(Outer)}
    assert list(options) == ["rate", "fast", "tied", "count", "where", "width", "shape"]
    assert options["width"].into == "inner" and options["rate"].into is None
    labels = {name: o.label() for name, o in options.items()}
    assert labels == {"rate": "4e-3", "fast": "no-fast", "tied": "tie", "count": None, "where": "here",
                      "width": "8", "shape": "a: round, b: square"}  # fmt: skip
    assert options["tied"].flag == "--tie" and options["fast"].flags == ("--fast/--no-fast",)
    help_text = CliRunner().invoke(_app({}), ["run", "--help"], env={"COLUMNS": "200"}).output
    for shown in (
        "[default: 4e-3]",
        "[default: a: round, b: square]",
        "--untie",
        "<digits>",
        "<round|square>",
    ):
        assert shown in help_text, shown


def test_given_values_reach_the_config_and_the_command_line_round_trips() -> None:
    seen: dict[str, Any] = {}
    args = [
        "run",
        "x",
        "--rate",
        "0.5",
        "--untie",
        "--count",
        "21k",
        "--width",
        "3",
        "--shape",
        "square",
        "--loud",
    ]
    result = CliRunner().invoke(_app(seen), args)
    assert result.exit_code == 0, result.output
    assert seen["config"] == Outer(rate=0.5, tied=False, count=21000, inner={"width": 3, "shape": "square"})
    assert seen["name"] == "x" and seen["loud"] is True
    assert sorted(seen["flags"]) == ["--count", "--rate", "--shape", "--untie", "--width"]
    untouched: dict[str, Any] = {}
    assert CliRunner().invoke(_app(untouched), ["run", "y"]).exit_code == 0
    assert untouched["config"] == Outer() and untouched["flags"] == []
    again: dict[str, Any] = {}
    assert CliRunner().invoke(_app(again), ["run", *seen["again"]]).exit_code == 0
    assert again["config"] == seen["config"] and again["name"] == "x" and again["loud"] is True


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--shape", "oval"], "'oval' is not one of 'round', 'square'"), (["--count", "x"], "give digits")],
)
def test_bad_values_name_the_option(args: list[str], words: str) -> None:
    result = CliRunner().invoke(_app({}), ["run", "x", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and words in lines[0] and args[0] in lines[0], (
        result.output
    )


def test_choices_hold_for_configs_built_in_code_and_names_stay_unique() -> None:
    with pytest.raises(UsageError, match="unknown shape 'oval': choose round or square"):
        check_choices(Inner(shape="oval"))

    @dataclass(frozen=True)
    class Clash:
        rate: float = setting(1.0, "Another rate.")

    with pytest.raises(AssertionError, match="rate"):
        with_options(options_of(Outer), options_of(Clash))


@dataclass(frozen=True)
class Bounded:
    target: Path = setting(MISSING, "Where to.")  # no default: a required option
    level: int = setting(5, "A level.", min=0, max=9)
    floor: int | None = setting(None, "A floor.", min=1)
    key: str | None = setting(None, "A key.", envvar="MINIGPT_TEST_KEY")

    def __post_init__(self) -> None:
        check_bounds(self)


def _bounded_app(seen: list[Bounded]) -> typer.Typer:
    app = typer.Typer(cls=_Group)

    @app.command()
    @with_options(options_of(Bounded))
    def run(given: Given = NO_OPTIONS) -> None:
        seen.append(Bounded(**given.of(Bounded)))

    @app.command()
    def other() -> None:
        pass

    return app


def test_bounds_environment_variables_and_required_options() -> None:
    help_text = CliRunner().invoke(_bounded_app([]), ["run", "--help"], env={"COLUMNS": "200"}).output
    for shown in ("[0<=x<=9]", "[x>=1]", "[env var: MINIGPT_TEST_KEY]", "[required]", "[default: 5]"):
        assert shown in help_text, shown
    seen: list[Bounded] = []
    app = _bounded_app(seen)
    assert CliRunner().invoke(app, ["run", "--target", "t"], env={"MINIGPT_TEST_KEY": "k"}).exit_code == 0
    assert CliRunner().invoke(app, ["run", "--target", "t", "--key", "given", "--level", "9"]).exit_code == 0
    assert seen == [Bounded(Path("t"), key="k"), Bounded(Path("t"), level=9, key="given")]
    for args, words in (
        (["run", "--target", "t", "--level", "10"], "--level"),
        (["run", "--target", "t", "--floor", "0"], "--floor"),
        (["run"], "missing option '--target'"),
    ):
        result = CliRunner().invoke(app, args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and words in lines[0], result.output


def test_bounds_hold_for_configs_built_in_code_and_a_command_may_reword_the_help() -> None:
    with pytest.raises(UsageError, match="--level must be from 0 to 9, got 10"):
        Bounded(Path("t"), level=10)
    with pytest.raises(UsageError, match="--floor must be at least 1, got 0"):
        Bounded(Path("t"), floor=0)
    assert Bounded(Path("t"), level=0, floor=None).level == 0
    level = options_of(Bounded)[1]
    assert level.with_help("Another level.").help_text() == "Another level. \\[default: 5]"
    assert level.help_text() == "A level. \\[default: 5]"
