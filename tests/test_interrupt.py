"""Ctrl-C during training: the first is acknowledged at once and its evaluation and save are shown; a second
exits at once with 130, saying what it discarded, and leaves the checkpoint on disk whole."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, FakeClock
from rich.console import Console
from test_train import TEXT, TINY, data_cfg, display_lines, tiny_cfg, training_start

from minigpt.cli.main import app
from minigpt.cli.training_display import TrainingDisplay
from minigpt.common.files import safetensors_metadata
from minigpt.errors import Interrupted
from minigpt.runs.folder import RunDir
from minigpt.train.loop import TrainConfig, TrainState, train
from minigpt.train.reporters import LineReporter


class Recorder(LineReporter):
    """A log that also records the events the display draws, and sends the second SIGINT at one of them."""

    def __init__(self, second_at: str | None = None) -> None:
        super().__init__(io.StringIO())
        self.events: list[tuple[Any, ...]] = []
        self.second_at = second_at

    def log(self, message: str) -> None:
        self.events.append(("log", message))

    def phase(self, what: str, done: int = 0, total: int = 0) -> None:
        self.events.append(("phase", what, done, total))
        if self.second_at is not None and what == self.second_at:
            self.second_at = None
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next line

    def stop_requested(self, signal_name: str) -> None:
        self.events.append(("stop_requested", signal_name))

    def close(self) -> None:
        self.events.append(("close",))


def ctrl_c_at(step: int):  # noqa: ANN201
    def on_step(now: int) -> None:
        if now == step:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_the_first_ctrl_c_is_told_at_once_then_its_evaluation_is_counted(
    text_file: Path, tmp_path: Path
) -> None:
    """The reporter hears of the request from the handler itself, then the log says which step is evaluated
    and saved, then the evaluation's windows are counted up to their total and the save is named."""
    rec = Recorder()
    result = train(tiny_cfg(max_iters=100, eval_every=50), data_cfg(text_file, tmp_path), out=tmp_path / "run",
                   reporter=rec, on_step=ctrl_c_at(6))  # fmt: skip
    assert result.interrupted and result.state.step == 6
    kinds = [e[0] for e in rec.events]
    first = kinds.index("stop_requested")
    assert rec.events[first] == ("stop_requested", "SIGINT")
    assert rec.events[first + 1] == ("log", "stopping: evaluating and saving step 6…")
    counted = [e for e in rec.events[first:] if e[0] == "phase" and e[1] == "evaluating step 6"]
    assert counted[0][2] == 0 and counted[-1][2] == counted[-1][3] > 0  # from none to all of them
    assert [e[2] for e in counted] == sorted(e[2] for e in counted)
    phases = [e for e in rec.events if e[0] == "phase"]
    assert phases[-2:] == [("phase", "saving step 6", 0, 0), ("phase", "", 0, 0)]
    assert ("close",) not in rec.events  # a run that ends normally is finished, not closed


@pytest.mark.parametrize("second_at", ["evaluating step 6", "saving step 6"])
def test_a_second_ctrl_c_says_which_steps_it_discards(
    text_file: Path, tmp_path: Path, second_at: str
) -> None:
    """Checkpoint at step 4, Ctrl-C at 6, Ctrl-C again during that stop's evaluation or just before its save:
    out at once, the display closed, steps 5-6 named as lost, and the run resumes from step 4."""
    out, rec = tmp_path / "run", Recorder(second_at=second_at)
    with pytest.raises(Interrupted) as caught:
        train(tiny_cfg(max_iters=100, eval_every=4), data_cfg(text_file, tmp_path), out=out, reporter=rec,
              on_step=ctrl_c_at(6))  # fmt: skip
    assert str(caught.value) == (
        "interrupted again: not saved; steps 5-6 since the last checkpoint at step 4 are lost; the run "
        f"resumes from step 4: minigpt train --resume {out}"
    )
    assert rec.events[-1] == ("close",)
    assert RunDir(out).checkpoint_step() == 4
    resumed = train(TrainConfig(max_iters=8), resume=out)
    assert [r["step"] for r in resumed.metrics if r["kind"] == "eval"] == [4, 8]


def test_a_second_ctrl_c_between_the_renames_of_a_save_waits_for_them(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands while the weights and the config.json describing them are renamed into place
    takes effect once both are there: the pair is never split, and the message tells what the state on
    disk (renamed after them) holds. Another thread is idle meanwhile, as the tokenizer's and rich's are in
    a real run: the kernel may hand the signal to it, and Python still runs the handler on the main thread."""
    out, real_replace, idle = tmp_path / "run", os.replace, threading.Event()

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if Path(dst).name == RunDir.WEIGHTS:
            os.kill(os.getpid(), signal.SIGINT)  # the second: the first came at step 6

    def at_step(step: int) -> None:
        if step == 6:
            monkeypatch.setattr(os, "replace", replace)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=idle.wait, daemon=True).start()
    try:
        with pytest.raises(Interrupted) as caught:
            train(
                tiny_cfg(max_iters=100, eval_every=4), data_cfg(text_file, tmp_path), out=out, on_step=at_step
            )
    finally:
        idle.set()
    assert "steps 5-6 since the last checkpoint at step 4 are lost" in str(caught.value)
    config = json.loads((out / RunDir.CONFIG).read_text())
    assert config["metrics"]["last"]["step"] == 6 == int(safetensors_metadata(out / RunDir.WEIGHTS)["step"])
    assert RunDir(out).checkpoint_step() == 4
    RunDir(out).load_model()


def test_the_display_says_it_is_stopping_from_the_moment_it_is_asked() -> None:
    """Drawn on the display's next refresh: the stop in place of the ETA and on a line of its own, then the
    evaluation's count with its bar, then the save; close() takes the live display down (cursor back)."""
    out = io.StringIO()
    display = TrainingDisplay(
        console=Console(file=out, force_terminal=True, width=80), live=True, clock=FakeClock()
    )
    display.start(training_start(TrainState()))
    assert not any("stopping" in line for line in display_lines(display))
    display.stop_requested("SIGINT")
    lines = display_lines(display)
    assert lines[1].startswith("elapsed 0:00  stopping  budget:")
    assert lines[-1] == "stopping (SIGINT): ending the current step, then evaluating and saving…"
    display.phase("evaluating step 1,250", 96, 192)
    last = display_lines(display)[-1]
    assert last.startswith("stopping (SIGINT): evaluating step 1,250…") and last.endswith(" 96/192 windows")
    display.phase("saving step 1,250")
    assert display_lines(display)[-1] == "stopping (SIGINT): saving step 1,250…"
    assert all(len(line) <= 80 for line in display_lines(display))
    drawn = len(out.getvalue())
    display.close()
    assert display._live is None and "\x1b[?25h" in out.getvalue()[drawn:]  # the cursor shown again


def test_the_display_shows_a_periodic_evaluation_without_a_stop() -> None:
    display = TrainingDisplay(console=Console(file=io.StringIO()), live=False, clock=FakeClock())
    display.start(training_start(TrainState()))
    display.phase("evaluating step 500", 0, 40)
    assert display_lines(display)[-1].startswith("evaluating step 500…")
    display.phase("")
    assert display_lines(display)[-1].startswith("val loss")


def test_ctrl_c_outside_a_run_says_interrupted(
    runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """typer would end the command with 130 and no word; the CLI says it was interrupted."""

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("minigpt.runs.summary.list_runs", interrupted)
    result = runner.invoke(app, ["runs", str(tmp_path)])
    assert result.exit_code == 130 and result.output.strip() == "interrupted"


@pytest.mark.slow
def test_ctrl_c_twice_in_a_real_process(tmp_path: Path) -> None:
    """SIGINT once training is under way (a logged step), again once the stop is acknowledged: exit 130,
    no traceback, and the last line says what the checkpoint on disk holds."""
    run = tmp_path / "run"
    (tmp_path / "text.txt").write_text(TEXT * 20, encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minigpt", "train", str(tmp_path / "text.txt"), *TINY, "--log-every", "1",
         "--max-iters", "1000000", "--eval-every", "3", "--eval-iters", "100000", "--out", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "MINIGPT_CACHE_DIR": str(tmp_path / "c")},
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []

    def read_until(prefix: str) -> str:
        while not (seen and seen[-1].startswith(prefix)):
            seen.append(proc.stderr.readline())  # type: ignore[union-attr]
            assert seen[-1], "".join(seen)  # the process ended first
        return seen[-1]

    read_until("step      4 ")  # a checkpoint at step 3 is on disk
    proc.send_signal(signal.SIGINT)
    stopping = read_until("stopping: ")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130 and "Traceback" not in err, err
    step = int(stopping.split("step ")[1].rstrip("…\n").replace(",", ""))
    last = err.strip().splitlines()[-1]
    saved = RunDir(run).checkpoint_step()
    if last.startswith("interrupted again: not saved"):  # the usual case: during the stop's evaluation
        assert saved is not None and 3 <= saved < step
        assert f"since the last checkpoint at step {saved} " in last and f"resumes from step {saved}:" in last
    else:  # the evaluation and save were done before the second signal came
        assert saved == step and (f"step {step} is saved" in last or "resume with:" in last), last
    RunDir(run).load_model()
