"""A time budget bounds the evaluations too: their batch count scales down, one that cannot finish inside
the budget is not started, and a run ends within a few percent of its budget however slow they are.

Everything runs on a fake clock: a training step costs 1 s (moved by `on_step`) and an evaluation forward
pass WINDOW seconds per window (moved by a wrapper around GPT.forward when the model is in eval mode), so
the budget logic is checked exactly and instantly, whatever the machine's load.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, FakeClock

from minigpt.data.dataset import DataConfig, prepare_data
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.train.budget import (
    EVAL_SHARE,
    EVAL_SLACK,
    EXIT_SECONDS,
    STEP_FORWARDS,
    STOP_EVAL_SECONDS,
    Budget,
    EvalCost,
)
from minigpt.train.loop import TrainConfig, TrainState, train
from minigpt.train.reporters import LineReporter

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n"
    for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 60)
)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def slow_evaluations(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, window_seconds: float) -> None:
    """Every window an evaluation's forward pass scores costs `window_seconds` on the fake clock."""
    forward = GPT.forward

    def slow(self: GPT, idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not self.training:
            clock.now += window_seconds * idx.size(0)
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", slow)


def timed_run(tmp_path: Path, text_file: Path, clock: FakeClock, **cfg: object) -> tuple[object, str]:
    def one_second_steps(step: int) -> None:
        clock.now += 1.0

    log = io.StringIO()
    settings = dict(preset="tiny", batch_size=4, eval_iters=50, log_every=10, warmup=2, device="cpu",
                    dtype="float32", **{"max_time": 90.0, **cfg})  # fmt: skip
    result = train(
        TrainConfig(**settings), DataConfig(paths=(text_file,), cache_dir=tmp_path / "cache"),
        out=tmp_path / "run", clock=clock, started=clock.now, on_step=one_second_steps,
        reporter=LineReporter(log),
    )  # fmt: skip
    return result, log.getvalue()


@pytest.mark.slow
def test_evaluations_scale_down_and_one_that_cannot_finish_is_not_started(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows cost 0.25 s: 50 batches of 4 windows on each split (96 windows: the validation split holds
    only 9) would take 24 s, over a quarter of a 92 s budget. They scale down to the 6 batches that fit in a
    tenth of it (8.25 s); the evaluations at steps 20 and 40 run, the one at 60 would not finish with the
    final one's time (and its slack) kept back, so it does not start; the run ends within a few percent of
    92 s, having trained every step that fitted."""
    clock = FakeClock()
    start = clock.now
    slow_evaluations(monkeypatch, clock, 0.25)
    result, log = timed_run(tmp_path, text_file, clock, eval_every=20, max_time=92.0)
    evals = [r for r in result.metrics if r["kind"] == "eval"]
    dataset = prepare_data(DataConfig(paths=(text_file,), cache_dir=tmp_path / "cache"), 32, progress=False)
    cost = EvalCost(0.25, 4, tuple((len(split) - 1) // 32 for split in (dataset.val, dataset.train)))
    assert cost.seconds(50) > 0.25 * 92.0 and cost.split_windows[0] < 50 * 4
    planned = cost.iters_within(EVAL_SHARE * 92.0, 50)
    assert result.stop_reason == "reached max_time 1 min 32 s"
    assert [r["step"] for r in evals] == [20, 40, result.state.step] and 60 < result.state.step < 80
    assert all(r["eval_iters"] == planned for r in evals) and planned == 6
    assert "skipped the evaluation at step 60: it would not finish within max_time" in log
    assert 0.95 * 92.0 <= clock.now - start + EXIT_SECONDS <= 92.0
    # what was not spent on start-up (a batch of windows, then the timed one), evaluations, the slack kept
    # for the last one and the exit went to steps, bar one
    trained = 92.0 - 2 * 4 * 0.25 - (len(evals) + EVAL_SLACK) * cost.seconds(planned) - EXIT_SECONDS
    assert trained - 2 <= result.state.step <= trained


@pytest.mark.slow
def test_an_evaluation_past_a_large_share_of_a_short_budget_is_skipped_and_the_weights_saved(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch of windows costs 24 s (a huge head on a loaded machine), more than a tenth of 90 s: no
    evaluation runs, not even the final one, and the run still ends on time with its weights saved."""
    clock = FakeClock()
    start = clock.now
    slow_evaluations(monkeypatch, clock, 3.0)
    result, log = timed_run(tmp_path, text_file, clock, eval_every=20)
    assert [r for r in result.metrics if r["kind"] == "eval"] == []
    assert "skipped the evaluation at step 20" in log and "no time left for the final evaluation" in log
    assert "not evaluated (no time was left for it)" in log
    assert clock.now - start + EXIT_SECONDS <= 90.0 and result.state.step >= 90 - 2 * 12 - 3
    model, _, config = RunDir(result.out).load_model()
    assert config["metrics"]["best_val_loss"] is None and model.num_params() > 0
    assert config["metrics"]["last"]["step"] == result.state.step  # `runs` and `params` show the steps


def test_a_first_step_that_cannot_finish_within_the_budget_is_not_begun(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward pass over a batch of 4 windows takes 4 s, so a step (forward and backward) should take
    about 12 s: with 10 s of budget none is begun, and the run ends in time with its untrained weights."""
    clock = FakeClock()
    start = clock.now
    slow_evaluations(monkeypatch, clock, 1.0)
    result, log = timed_run(tmp_path, text_file, clock, max_time=10.0)
    assert result.state.step == 0 and result.stop_reason == "reached max_time 10 s"
    assert clock.now - start + EXIT_SECONDS <= 10.0 and RunDir(result.out).weights_path.is_file()


def test_a_late_run_skips_the_final_evaluation_and_says_by_how_much_it_ran_over(
    tmp_path: Path, text_file: Path
) -> None:
    """Start-up alone took 5 s of a 2 s budget: no step, no evaluation, a save and one line saying so."""
    clock, log = FakeClock(), io.StringIO()
    cfg = TrainConfig(preset="tiny", batch_size=4, eval_iters=2, device="cpu", max_time=2.0)
    result = train(
        cfg, DataConfig(paths=(text_file,), cache_dir=tmp_path / "c"), out=tmp_path / "run", clock=clock,
        started=clock.now - 5, reporter=LineReporter(log),
    )  # fmt: skip
    assert result.state.step == 0 and "done: reached max_time 2 s after 0 steps" in log.getvalue()
    assert "over budget: the run took 3.0 s more than its max_time" in log.getvalue()
    assert RunDir(result.out).weights_path.is_file()


def test_eval_cost_and_the_budget_arithmetic() -> None:
    cost = EvalCost(window_seconds=0.5, batch_windows=4, split_windows=(10, 100))
    assert cost.windows(1) == 8 and cost.windows(3) == 10 + 12 and cost.windows(1000) == 110
    assert cost.seconds(2) == 8.0 and cost.iters_within(8.0, 50) == 2 and cost.iters_within(7.9, 50) == 1
    assert cost.iters_within(1e9, 50) == 50 and cost.iters_within(3.9, 50) == 0
    budget = Budget(max_time=100.0, eval_iters=50, eval_cost=cost, save_seconds=2.0)
    budget.keep_reserve()  # a tenth of 100 s fits 2 batches (8 s, kept with its slack); the save; the exit
    kept = (1 + EVAL_SLACK) * 8.0
    assert budget.planned_eval_iters() == 2 and budget.reserve == kept + 2.0 + EXIT_SECONDS
    assert budget.eval_iters_now(TrainState(elapsed=50.0), final=False) == 2
    # a periodic one must finish before the final one's reserve (its 8 s and slack, the save's 2 s and the
    # exit): within 100 s less the save and the exit, less that reserve, less its own 8 s
    edge = 100.0 - 2.0 - EXIT_SECONDS - (kept + 2.0 + EXIT_SECONDS) - 8.0
    assert budget.eval_iters_now(TrainState(elapsed=edge), final=False) == 2
    assert budget.eval_iters_now(TrainState(elapsed=edge + 0.1), final=False) == 0
    # the final one takes what is left, up to the planned batches
    assert budget.eval_iters_now(TrainState(elapsed=89.0), final=True) == 2
    assert budget.eval_iters_now(TrainState(elapsed=92.0), final=True) == 1
    assert budget.eval_iters_now(TrainState(elapsed=95.0), final=True) == 0
    budget.observe_eval(eval_seconds=16.0, windows=16, save_seconds=1.0)  # twice as slow as estimated
    assert cost.window_seconds == 1.0 and budget.planned_eval_iters() == 1
    assert budget.reserve == kept + 1.0 + EXIT_SECONDS
    untimed = Budget(max_iters=10, eval_iters=50, eval_cost=cost)  # no time budget: always everything
    assert untimed.eval_iters_now(TrainState(elapsed=1e9), final=False) == 50
    assert untimed.eval_iters_now(TrainState(elapsed=1e9), final=True) == 50


def test_the_steps_left_count_the_time_an_evaluation_would_take() -> None:
    """At 50 s of a 100 s budget with 10 s kept back and 1 s steps, 39 steps are left (the last must start by
    89 s); an 8 s evaluation first leaves 31: what decides whether the final evaluation would follow it
    within half an interval. Without a timed step or a step budget nothing is known."""
    budget = Budget(max_time=100.0, reserve=10.0)
    assert budget.steps_left(TrainState(step=50, elapsed=50.0), tokens_per_step=64) is None
    budget.observe_step(1.0)
    assert budget.steps_left(TrainState(step=50, elapsed=50.0), tokens_per_step=64) == pytest.approx(39.0)
    assert budget.steps_left(TrainState(step=50, elapsed=50.0), 64, busy=8.0) == pytest.approx(31.0)
    assert budget.steps_left(TrainState(step=50, elapsed=50.0), 64, busy=1e9) == 0.0
    steps = Budget(max_iters=60)
    assert steps.steps_left(TrainState(step=50), 64, busy=8.0) == 10.0  # a step budget ignores time


def test_a_stopped_run_evaluates_only_what_fits_in_a_few_seconds() -> None:
    """After Ctrl-C the final evaluation takes the batches that fit in STOP_EVAL_SECONDS, costed by the
    measured window or else by the step time; none before either is known."""
    cost = EvalCost(window_seconds=0.0, batch_windows=4, split_windows=(1000, 1000))
    untimed = Budget(max_iters=100, eval_iters=50, eval_cost=cost, step_windows=4)
    assert untimed.eval_iters_now(TrainState(), final=True, stopping=True) == 0  # no step timed yet
    untimed.observe_step(STEP_FORWARDS * 4 * 0.1)  # a window's forward pass: 0.1 s, so 8 windows a batch
    assert untimed.eval_iters_now(TrainState(), final=True, stopping=True) == int(STOP_EVAL_SECONDS / 0.8)
    assert untimed.eval_iters_now(TrainState(), final=True) == 50  # not stopped: all of them
    timed = Budget(max_time=100.0, eval_iters=50, eval_cost=EvalCost(1.0, 4, (1000, 1000)), step_windows=4)
    assert timed.eval_iters_now(TrainState(elapsed=10.0), final=True, stopping=True) == 0  # 8 s a batch
    timed.eval_cost.window_seconds = STOP_EVAL_SECONDS / 24  # 3 batches fit, and the time budget allows 2
    timed.save_seconds = 100.0 - 10.0 - EXIT_SECONDS - 2.5 * 8 * timed.eval_cost.window_seconds
    assert timed.eval_iters_now(TrainState(elapsed=10.0), final=True, stopping=True) == 2
    timed.save_seconds = 0.0
    assert timed.eval_iters_now(TrainState(elapsed=10.0), final=True, stopping=True) == 3


def test_a_commands_clock_starts_with_its_process() -> None:
    """`minigpt` run as a program counts its budget from the process's start, so the interpreter's start-up
    and imports are part of the wall time a --max-time bounds (perf_counter is one monotonic clock across
    processes on Linux; /proc gives the start to a tick, 10 ms)."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc")
    code = (
        "import time; first = time.perf_counter()\n"
        "from minigpt.train.budget import process_started\n"
        "print(first, process_started())\n"
    )
    before = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    first, started = map(float, proc.stdout.split())
    assert before - 0.03 <= started <= first
