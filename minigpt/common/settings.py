"""Settings declared once, on their config dataclass: a field's metadata holds its help, help panel, choices,
option names and parser, and every command line option, its help and the default it states are read from
there. Plain data: no torch, no typer (`minigpt.cli.typer_options` turns these into typer options).

Adding an option is adding a field:

    warmup: int = setting(100, "Linear warmup steps.", panel=OPT)
    pos: str = setting("learned", "Positions.", panel=ARCH, choices=POSITIONS, by=ARCHS)
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from typing import Any

from minigpt.errors import UsageError

# help panels, in the order `--help` shows them
MODEL = "Model shape"
ARCH = "Architecture"
DATA = "Data and tokenizer"
OPT = "Optimisation"
BUDGET = "Budget (the first reached stops)"
EVAL = "Evaluation and logging"
RUN = "Run"
FINETUNE = "Fine-tuning (with --init-from)"
FEEDBACK = "Learning from feedback (preference pairs, tasks)"
PANELS = (MODEL, ARCH, DATA, OPT, FINETUNE, FEEDBACK, BUDGET, EVAL, RUN)

_SETTING = "minigpt.setting"
_NESTED = "minigpt.nested"


@dataclass(frozen=True)
class Setting:
    """How a config field shows on the command line."""

    help: str
    panel: str | None = None
    choices: tuple[str, ...] = ()  # the values it accepts, checked as the option is parsed
    flags: tuple[str, ...] = ()  # option names; default --field-name (a bool: --field-name/--no-field-name)
    parse: Callable[[str], Any] | None = (
        None  # reads the option's text (and str() of what it gave) into a value
    )
    shown: str | None = None  # the default as help states it, where the field's default does not say it
    by: Mapping[str, Mapping[str, Any]] | None = None  # defaults by case: {case: {field: value}}, a case
    # that leaves a field out keeping another's (help names the cases that set it)
    metavar: str | None = None  # what help shows for the value, where its type does not say it
    min: float | None = None  # the smallest value it takes (checked as parsed, and by check_bounds)
    max: float | None = None  # the largest value it takes
    envvar: str | None = None  # an environment variable that gives it when the option is not given


def setting(default: Any = None, help: str = "", **how: Any) -> Any:
    """A dataclass field with `default` that is also a command line option (see `Setting` for `how`);
    a `default` of MISSING makes both required."""
    return field(default=default, metadata={_SETTING: Setting(help, **how)})


def nested(config: type, skip: tuple[str, ...] = ()) -> Any:
    """A dict field holding fields of another config, given one by one as that config's options (minus
    `skip`): how TrainConfig takes GPTConfig's fields over its preset and architecture."""
    return field(default_factory=dict, metadata={_NESTED: (config, skip)})


@dataclass(frozen=True)
class Option:
    """One setting as an option: the field it sets and how."""

    name: str  # the field's name, and the option's parameter name
    kind: Any  # the field's type without None: int, float, str, bool or Path
    default: Any  # the field's default (MISSING: none)
    setting: Setting
    into: str | None = None  # the dict field of the outer config it is collected into (nested)

    @property
    def flags(self) -> tuple[str, ...]:
        if self.setting.flags:
            return self.setting.flags
        dashed = self.name.replace("_", "-")
        return (f"--{dashed}/--no-{dashed}",) if self.kind is bool else (f"--{dashed}",)

    @property
    def flag(self) -> str:
        """The option's first name, as messages cite it: --n-layer, --tie."""
        return self.flags[0].split("/")[0]

    def spell(self, value: Any) -> str:
        """A value as the help writes it: a bool as the flag that sets it, 8e-3 rather than 0.008."""
        if isinstance(value, bool):
            on, _, off = self.flags[0].partition("/")  # a lone flag (--overwrite) has no off form
            return (on if value or not off else off).removeprefix("--")
        return number(value) if isinstance(value, int | float) else str(value)

    def label(self) -> str | None:
        """The default as help states it (None: it has none)."""
        s = self.setting
        if s.shown is not None:
            return s.shown
        if s.by is not None:
            cases = ((case, values[self.name]) for case, values in s.by.items() if self.name in values)
            return ", ".join(f"{case}: {self.spell(value)}" for case, value in cases)
        if (
            self.default is None
            or self.default is MISSING
            or (self.default is False and "/" not in self.flags[0])
        ):
            return None  # no default, or a flag that is off unless given
        return self.spell(self.default)

    def help_text(self) -> str:
        """The help with its default appended (the bracket escaped: the help is rich markup, where
        [default: ...] would read as a style and vanish)."""
        label = self.label()
        return f"{self.setting.help} \\[default: {label}]" if label is not None else self.setting.help

    def with_label(self, shown: str) -> Option:
        """This option stating another default (a command that fills it differently)."""
        return replace(self, setting=replace(self.setting, shown=shown, by=None))

    def with_help(self, help: str) -> Option:
        """This option with the help of one command that uses it (`--overwrite` replaces different things)."""
        return replace(self, setting=replace(self.setting, help=help))


def number(value: float) -> str:
    """8e-3 rather than 0.008 for small rates, 10000 rather than 10000.0."""
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _without_none(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


@cache
def options_of(config: type, skip: tuple[str, ...] = ()) -> tuple[Option, ...]:
    """The options of a config dataclass, in field order, nested configs' in the place of their field."""
    hints = typing.get_type_hints(config)
    found: list[Option] = []
    for f in fields(config):
        if f.name in skip:
            continue
        if _NESTED in f.metadata:
            inner, inner_skip = f.metadata[_NESTED]
            found += [replace(o, into=f.name) for o in options_of(inner, inner_skip)]
        elif _SETTING in f.metadata:
            found.append(Option(f.name, _without_none(hints[f.name]), f.default, f.metadata[_SETTING]))
    return tuple(found)


def check_choices(config: Any) -> None:
    """A one-line error unless every setting of `config` with choices holds one of them (or None)."""
    for o in options_of(type(config)):
        value = getattr(config, o.name, None) if o.into is None else None
        if o.setting.choices and value is not None and value not in o.setting.choices:
            raise UsageError(f"unknown {o.name} {value!r}: choose {' or '.join(o.setting.choices)}")


def check_bounds(config: Any) -> None:
    """A one-line error unless every setting of `config` with bounds lies within them (or is None)."""
    for o in options_of(type(config)):
        value, low, high = getattr(config, o.name, None), o.setting.min, o.setting.max
        if o.into is not None or value is None or (low is None and high is None):
            continue
        if high is None and value < low:
            raise UsageError(f"{o.flag} must be at least {number(low)}, got {o.spell(value)}")
        if low is None and value > high:
            raise UsageError(f"{o.flag} must be at most {number(high)}, got {o.spell(value)}")
        if low is not None and high is not None and not low <= value <= high:
            raise UsageError(f"{o.flag} must be from {number(low)} to {number(high)}, got {o.spell(value)}")


def nested_names(config: type, name: str) -> tuple[str, ...]:
    """The fields the dict field `name` of `config` may hold."""
    return tuple(o.name for o in options_of(config) if o.into == name)


class Given:
    """The setting options a command line gave (left out: absent), turned into configs' arguments."""

    def __init__(self, values: Mapping[str, Any], options: tuple[Option, ...]) -> None:
        self.options = {o.name: o for o in options}
        self.values = {k: v for k, v in values.items() if v is not None}

    def items(self) -> Iterator[tuple[Option, Any]]:
        return ((self.options[name], value) for name, value in self.values.items())

    def of(self, config: type) -> dict[str, Any]:
        """Keyword arguments for `config`: its own fields given, nested ones collected in their dict."""
        kwargs: dict[str, Any] = {}
        for o in options_of(config):
            if o.name in self.values:
                target = kwargs.setdefault(o.into, {}) if o.into else kwargs
                target[o.name] = self.values[o.name]
        return kwargs

    def flags(self, *, skip: tuple[str, ...] = ()) -> list[str]:
        """The given options' names as a user typed them (--n-layer), minus `skip` (field names)."""
        return [
            "--" + o.spell(v) if isinstance(v, bool) else o.flag
            for o, v in self.items()
            if o.name not in skip
        ]


NO_OPTIONS = Given({}, ())  # a command's `given` parameter before `minigpt.cli.typer_options` fills it in
