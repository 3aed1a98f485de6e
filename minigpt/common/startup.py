"""A command's start-up without the garbage collector's passes over what start-up makes.

Importing typer, numba's compiler or torch and loading a model make hundreds of thousands of long-lived
objects, and Python's cyclic collector walks all of them again each time enough new ones have come, and
once more as the interpreter exits: a sizeable share of a short `minigpt generate`, spent on objects
that live until the end anyway. So the command line runs its start-up (imports, parsing) and every model
load with the collector off, then freezes what they made (`gc.freeze`: later passes skip those objects,
which stay alive as long as anything refers to them, as before) and turns it back on, so a long `train`
or `serve` still collects its own garbage. Only the command line process does this (`minigpt.cli.main.main`
calls `pause`): a program or a test that imports minigpt keeps its collector as it is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_state = {"cli": False}


def pause() -> None:
    """The command line process starts: the collector stays off until `settle`."""
    _state["cli"] = True
    gc.disable()


def settle() -> None:
    """Start-up is over: freeze what it made and turn the collector back on (the command line only)."""
    if _state["cli"]:
        gc.freeze()
        gc.enable()


@contextmanager
def loading() -> Iterator[None]:
    """A model load (weights, compiled kernels and their imports) with the collector off, settled after
    (the command line only); as a decorator, each call of the function is one."""
    if not _state["cli"]:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        settle()


def exiting() -> None:
    """The command is done: freeze everything, so the interpreter's last collection walks nothing."""
    if _state["cli"]:
        gc.freeze()
