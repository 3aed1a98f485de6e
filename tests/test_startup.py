"""The command line's start-up without collector passes (minigpt.common.startup): off while it imports, parses
and loads, back on (with what start-up made frozen) before the command's own work; untouched elsewhere."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from minigpt.common import startup

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def collector() -> Iterator[None]:
    """Whatever a test does to the collector and the command-line flag is undone after it."""
    enabled, cli = gc.isenabled(), startup._state["cli"]
    yield
    gc.unfreeze()
    startup._state["cli"] = cli
    (gc.enable if enabled else gc.disable)()


def test_a_program_that_imports_minigpt_keeps_its_collector(collector: None) -> None:
    startup._state["cli"] = False
    frozen = gc.get_freeze_count()
    startup.settle()
    with startup.loading():
        assert gc.isenabled()
    startup.exiting()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_command_line_collects_again_once_started_and_after_each_load(collector: None) -> None:
    startup.pause()
    assert not gc.isenabled()
    kept = [object() for _ in range(3)]
    kept.append(kept)  # tracked by the collector: a list that holds itself
    startup.settle()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    with startup.loading():
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    with pytest.raises(RuntimeError), startup.loading():  # a load that fails still turns it back on
        raise RuntimeError("unreadable weights")
    assert gc.isenabled()


@pytest.mark.slow
def test_a_command_collects_its_own_garbage() -> None:
    """A real `minigpt` process: by the time the command runs, the collector is on again and finds a
    cycle the command leaves behind (so a long `train` or `serve` does not grow without bound)."""
    code = (
        "import gc, sys\n"
        "from minigpt.cli import main as cli; from minigpt.common import startup\n"
        "def check():\n"
        "    a = []; a.append(a); del a\n"
        "    print(gc.isenabled(), gc.collect() >= 1, gc.get_freeze_count() > 0)\n"
        "original = startup.settle\n"
        "def settle():\n"
        "    original(); check()\n"
        "startup.settle = settle\n"
        "sys.argv = ['minigpt', 'runs', '--help']\n"
        "cli.main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "True True True"
