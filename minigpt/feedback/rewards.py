"""Rewards a run can check: how one answer to a task is scored, named by `--reward`.

- `exact` (the default): 1 when the answer, stripped of surrounding whitespace, is the task's "answer"
  (stripped too), else 0.
- `regex:PATTERN`: 1 when Python's `re.search(PATTERN, answer)` finds the pattern, else 0 (anchor it with
  ^ and $ to match the whole answer).
- `module:function` or `path/to/file.py:function`: `function(answer, record)` with the answer's text and the
  task's JSONL record (a dict), returning a number (a bool counts as 0 or 1). It is imported and run in this
  process, with the current folder first on the import path: trusted code, the user's own choice, like any
  Python they run. An exception, a result that is not a finite number, or a call that outlasts its timeout
  stops the run with one line naming the function; a call stuck in C code that holds the GIL cannot be cut
  short.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import queue
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from minigpt.errors import MinigptError, UsageError

if TYPE_CHECKING:
    from minigpt.feedback.records import Task

EXACT = "exact"
REGEX = "regex:"
REWARD_CHOICES = "exact, regex:PATTERN, or module:function (also path/to/file.py:function)"


class Reward(Protocol):
    """Scores an answer (its text) to a task."""

    name: str
    needs_answer: bool  # whether tasks must hold a reference "answer"

    def __call__(self, answer: str, task: Task) -> float: ...


class ExactMatch:
    name = EXACT
    needs_answer = True

    def __call__(self, answer: str, task: Task) -> float:
        return float(task.answer is not None and answer.strip() == task.answer.strip())


@dataclass
class Pattern:
    pattern: re.Pattern[str]
    needs_answer = False

    @property
    def name(self) -> str:
        return f"{REGEX}{self.pattern.pattern}"

    def __call__(self, answer: str, task: Task) -> float:
        return float(self.pattern.search(answer) is not None)


@dataclass
class PythonReward:
    """A user's function, called on a daemon thread so that a call past `timeout` seconds can be given up
    (the thread is left behind: the run stops)."""

    name: str
    function: Callable[[str, dict[str, Any]], Any]
    timeout: float
    needs_answer = False
    _worker: _Worker | None = field(default=None, repr=False)

    def __call__(self, answer: str, task: Task) -> float:
        if self._worker is None:
            self._worker = _Worker()
        try:
            value = self._worker.call(self.function, (answer, task.record), self.timeout)
        except TimeoutError:
            self._worker = None  # it is stuck in the call: the next one gets a new thread
            raise MinigptError(
                f"reward {self.name} took longer than {self.timeout:g} s on one answer (--reward-timeout)"
            ) from None
        except Exception as e:
            detail = str(e).splitlines()[0][:200] if str(e) else ""
            raise MinigptError(
                f"reward {self.name} raised {type(e).__name__}{': ' + detail if detail else ''}"
            ) from None
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            return float(value)
        shown = repr(value)[:60]
        raise MinigptError(
            f"reward {self.name} returned {shown} ({type(value).__name__}): a reward must be a finite number"
        )


class _Worker:
    """One daemon thread running calls in turn; the caller waits for each at most a timeout."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._serve, name="minigpt-reward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            function, args, reply = self._jobs.get()
            try:
                reply.put((True, function(*args)))
            except BaseException as e:  # handed to the caller, which names it
                reply.put((False, e))

    def call(self, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self._jobs.put((function, args, reply))
        try:
            ok, value = reply.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if not ok:
            raise value
        return value


def make_reward(spec: str, timeout: float) -> Reward:
    """The reward `spec` names (see the module's docstring); a `module:function` one is imported now."""
    if spec == EXACT:
        return ExactMatch()
    if spec.startswith(REGEX):
        try:
            return Pattern(re.compile(spec.removeprefix(REGEX)))
        except re.error as e:
            raise UsageError(f"--reward {spec!r} is not a regular expression Python reads ({e})") from None
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise UsageError(f"unknown --reward {spec!r}: give {REWARD_CHOICES}")
    function = getattr(_import(module, spec), name, None)
    if not callable(function):
        raise UsageError(f"--reward {spec}: {module} has no function {name}")
    return PythonReward(spec, function, timeout)


def _import(module: str, spec: str) -> Any:
    """A module by its import name (the current folder first on the path) or its .py file."""
    try:
        if module.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(module).stem, module)
            if found is None or found.loader is None or not Path(module).is_file():
                raise ImportError(f"no file {module}")
            loaded = importlib.util.module_from_spec(found)
            found.loader.exec_module(loaded)
            return loaded
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(module)
    except Exception as e:  # the module's own code may raise anything while it loads
        raise UsageError(f"--reward {spec}: cannot import {module} ({type(e).__name__}: {e})") from None
