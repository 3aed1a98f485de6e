"""Typer options made from the settings the configs declare (`minigpt.common.settings`): a command lists the
configs whose settings it takes, and receives the options given as one `Given` argument."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import MISSING
from typing import Annotated, Any, Literal, TypeVar

import typer

from minigpt.common.settings import PANELS, Given, Option
from minigpt.errors import MinigptError

Command = TypeVar("Command", bound=Callable[..., Any])


def _reader(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its one-line error reported as a bad value of the option (click names the option)."""

    def read(text: str) -> Any:
        try:
            return parse(text)
        except MinigptError as e:
            raise typer.BadParameter(str(e)) from None

    return read


def _parameter(option: Option) -> inspect.Parameter:
    """The typer parameter of an option: None when not given, so a config's own default applies (one
    whose field has no default is required)."""
    s = option.setting
    kind = Literal[s.choices] if s.choices else option.kind  # type: ignore[valid-type]
    info = typer.Option(
        *option.flags,
        help=option.help_text(),
        rich_help_panel=s.panel,
        parser=_reader(s.parse) if s.parse else None,
        metavar=s.metavar,
        min=s.min,
        max=s.max,
        envvar=s.envvar,
        show_envvar=s.envvar is not None,
    )
    required = option.default is MISSING
    return inspect.Parameter(
        option.name,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=... if required else None,  # typer: ... is required
        annotation=Annotated[kind if required else kind | None, info],
    )


def _panel_order(option: Option) -> int:
    return PANELS.index(option.setting.panel) if option.setting.panel in PANELS else len(PANELS)


def with_options(*groups: Iterable[Option]) -> Callable[[Command], Command]:
    """Give a typer command the options of these settings, grouped by help panel, where its `given`
    parameter stands; the command receives what was given as `given` (a `Given`)."""
    options = tuple(sorted((o for group in groups for o in group), key=_panel_order))
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise AssertionError(
            f"two settings share an option name: {sorted(n for n in names if names.count(n) > 1)}"
        )

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        if set(names) & set(signature.parameters):
            raise AssertionError(f"{command.__name__} declares a setting's option itself")
        parameters: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            parameters += [_parameter(o) for o in options] if p.name == "given" else [p]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name, None) for name in names}
            return command(*args, given=Given(values, options), **kwargs)

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate


def command_line(ctx: typer.Context, skip: tuple[str, ...] = ()) -> list[str]:
    """The options and arguments this command was given, spelled out again (minus `skip`, parameter
    names): how `train --nproc` hands its own command line to the processes it starts."""
    args: list[str] = []
    positional: list[str] = []
    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        if p.name in skip or value is None or (value is False and not p.secondary_opts):
            continue
        if p.param_type_name == "argument":
            positional += [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
        elif isinstance(value, bool):
            args.append(p.opts[0] if value else p.secondary_opts[0])
        else:
            args += [p.opts[0], str(value)]
    return args + (["--", *positional] if positional else [])
