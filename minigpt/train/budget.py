"""A training budget: how far along a run is, when it stops, the time it keeps for the end, what its
evaluations may cost, and the lr."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.train.config import WARMUP_FRACTION, TrainConfig, format_seconds

if TYPE_CHECKING:
    from minigpt.train.checkpoint import TrainState

# weight of the newest step in the running estimate of seconds per step
STEP_TIME_WEIGHT = 0.1
# what a command still does after its final save: the summary, leaving the process group, and exiting
# Python (short, since the command line freezes its start-up objects before the interpreter's last garbage
# collection: minigpt.common.startup)
EXIT_SECONDS = 0.5
# a training step against a forward pass of the same batch: the backward pass costs about two more
STEP_FORWARDS = 3
# under a time budget an evaluation takes at most this share of it: fewer batches of windows when they cost
# more (a 50,257-token head, a wide model, a loaded machine), none when one batch costs more than that
EVAL_SHARE = 0.1
# the time kept back for the final evaluation is its measured cost and this share more: on a shared machine
# an evaluation can take longer than the one measured before it, and the run must still end by max_time
EVAL_SLACK = 0.25
# a run stopped by a signal (Ctrl-C, a scheduler's SIGTERM) evaluates for at most this long before its save:
# a full evaluation through a large vocabulary's head on a small CPU takes far longer, and whoever stopped
# the run is waiting
STOP_EVAL_SECONDS = 5.0


def process_started(clock: Callable[[], float] = time.perf_counter) -> float:
    """A `clock` reading of when this process started (Linux: from /proc; elsewhere: now), so that the wall
    time of a whole command counts the interpreter's start-up and imports too (seconds on a loaded machine)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
        age = float(Path("/proc/uptime").read_text().split()[0]) - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return clock()
    return clock() - max(age, 0.0)


@dataclass
class EvalCost:
    """What an evaluation costs one process: seconds per window, and the windows `iters` batches cover on
    each split (a short split has fewer than asked for)."""

    window_seconds: float = 0.0  # 0: not measured yet
    batch_windows: int = 1  # windows a batch adds to each split, per process
    split_windows: tuple[int, ...] = ()  # windows each split holds, per process

    def windows(self, iters: int) -> int:
        return sum(min(iters * self.batch_windows, n) for n in self.split_windows)

    def seconds(self, iters: int) -> float:
        return self.window_seconds * self.windows(iters)

    def iters_within(self, seconds: float, most: int) -> int:
        """The most batches, up to `most`, an evaluation can take and still finish within `seconds`."""
        low, high = 0, most
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.seconds(mid) <= seconds else (low, mid - 1)
        return low


@dataclass
class Budget:
    """The first of max_iters, max_time and max_tokens reached stops the run.

    Steps and tokens count over the whole run. Time counts the run's elapsed seconds from `time_from`: 0 for
    a budget set when the run started, so a resume carries the time already spent, or where the resume that
    set a new max_time began, so that budget is that command's own time.
    """

    max_iters: int | None = None
    max_time: float | None = None  # seconds
    max_tokens: int | None = None
    time_from: float = 0.0
    # seconds kept at the end of a time budget for the final evaluation and save
    reserve: float = 0.0
    # running estimate of the seconds one optimizer step takes (0: not measured yet)
    step_seconds: float = 0.0
    # until a step is timed, what one should take: forward and backward, three forward passes of a batch
    step_estimate: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    origin: float = 0.0  # clock reading at which the run's elapsed time was 0
    eval_iters: int = 0  # batches an evaluation takes when time allows (the config's eval_iters)
    eval_cost: EvalCost = field(default_factory=EvalCost)
    step_windows: int = 1  # windows one optimizer step trains on, per process
    save_seconds: float = 0.0  # what a checkpoint takes to write, estimated, then measured

    @classmethod
    def of(
        cls, cfg: TrainConfig, state: TrainState, clock: Callable[[], float] = time.perf_counter
    ) -> Budget:
        budget = cls(cfg.max_iters, cfg.max_time, cfg.max_tokens, state.time_budget_from, clock=clock)
        budget.eval_iters = cfg.eval_iters
        return budget

    def start(self, started: float | None, elapsed: float) -> None:
        """Count the run's elapsed time on from `elapsed` seconds at clock reading `started` (None: now)."""
        self.origin = (self.clock() if started is None else started) - elapsed

    def elapsed(self) -> float:
        return self.clock() - self.origin

    def time_used(self, state: TrainState) -> float:
        return state.elapsed - self.time_from

    def observe_step(self, seconds: float) -> None:
        """Fold one step's duration into the estimate of seconds per step."""
        if self.step_seconds <= 0:
            self.step_seconds = seconds
        else:
            self.step_seconds += STEP_TIME_WEIGHT * (seconds - self.step_seconds)

    def _time_for_steps(self) -> float:
        """Of max_time, the seconds by which the last step must have started."""
        assert self.max_time is not None
        return max(self.max_time - self.reserve - (self.step_seconds or self.step_estimate), 1e-9)

    def progress(self, state: TrainState) -> float:
        """Fraction of the budget used, in [0, 1]: the largest of steps, time and tokens."""
        parts = [0.0]
        if self.max_iters is not None:
            parts.append(state.step / self.max_iters)
        if self.max_time is not None:
            parts.append(self.time_used(state) / self._time_for_steps())
        if self.max_tokens is not None:
            parts.append(state.tokens / self.max_tokens)
        return min(max(parts), 1.0)

    def out_of_time(self) -> bool:
        """Whether the time budget, less the reserve for the final evaluation and save, is spent now."""
        return self.max_time is not None and self.elapsed() - self.time_from + self.reserve >= self.max_time

    def stop_reason(self, state: TrainState) -> str | None:
        """Why the run stops before another step, or None. Under a time budget the next step and the
        final evaluation and save must still fit."""
        if self.max_iters is not None and state.step >= self.max_iters:
            return f"reached max_iters {self.max_iters:,}"
        if self.max_time is not None and self.time_used(state) >= self._time_for_steps():
            return f"reached max_time {format_seconds(self.max_time)}"
        if self.max_tokens is not None and state.tokens >= self.max_tokens:
            return f"reached max_tokens {self.max_tokens:,}"
        return None

    def total_steps(self, state: TrainState, tokens_per_step: int, busy: float = 0.0) -> float | None:
        """The steps the budget allows in all, as far as known (a time budget once a step was timed), when
        `busy` seconds of the time left go to something else (an evaluation)."""
        limits: list[float] = []
        if self.max_iters is not None:
            limits.append(self.max_iters)
        if self.max_tokens is not None:
            limits.append(self.max_tokens / tokens_per_step)
        if self.max_time is not None and self.step_seconds > 0:
            left = self._time_for_steps() - self.time_used(state) - busy
            limits.append(state.step + max(left, 0.0) / self.step_seconds)
        return min(limits) if limits else None

    def steps_left(self, state: TrainState, tokens_per_step: int, busy: float = 0.0) -> float | None:
        """The steps the budget still allows, as far as known (None: no budget says yet), after `busy`
        seconds spent otherwise."""
        total = self.total_steps(state, tokens_per_step, busy)
        return None if total is None else max(total - state.step, 0.0)

    def warmup_steps(self, warmup: int, state: TrainState, tokens_per_step: int) -> int:
        """`warmup`, capped at WARMUP_FRACTION of the steps the budget allows."""
        total = self.total_steps(state, tokens_per_step)
        if not warmup or total is None:
            return warmup
        return min(warmup, max(1, math.floor(WARMUP_FRACTION * total)))

    def overrun(self, elapsed: float) -> float:
        """Seconds a run `elapsed` seconds long went past its time budget (0: it kept to it, or has none)."""
        if self.max_time is None:
            return 0.0
        return max(0.0, elapsed - self.time_from - self.max_time)

    # --- evaluations under a time budget --------------------------------------------------------------

    def planned_eval_iters(self) -> int:
        """Batches a periodic evaluation takes: eval_iters, or under a time budget as many as fit in its
        EVAL_SHARE (0 when even one does not: then only the final evaluation runs, if time is left)."""
        if self.max_time is None or self.eval_cost.window_seconds <= 0:
            return self.eval_iters
        return self.eval_cost.iters_within(EVAL_SHARE * self.max_time, self.eval_iters)

    def keep_reserve(self) -> None:
        """Keep back what the final evaluation (planned size, and EVAL_SLACK more), its save and the exit
        will take."""
        evaluation = (1 + EVAL_SLACK) * self.eval_cost.seconds(self.planned_eval_iters())
        self.reserve = evaluation + self.save_seconds + EXIT_SECONDS

    def observe_eval(self, eval_seconds: float, windows: int, save_seconds: float) -> None:
        """Fold a measured evaluation (of `windows` windows) and save into the costs and the reserve."""
        if windows > 0:
            self.eval_cost.window_seconds = eval_seconds / windows
        self.save_seconds = save_seconds
        self.keep_reserve()

    def eval_iters_now(self, state: TrainState, final: bool, stopping: bool = False) -> int:
        """Batches the evaluation due now may take; 0: skip it. Each takes the planned batches (so every
        evaluation of a command scores the same windows), a periodic one only if it can finish with the
        final one's time still kept back, the final one fewer, or none, when the run is late. The final one
        of a run a signal stopped (`stopping`) takes only what fits in STOP_EVAL_SECONDS."""
        if stopping:
            return min(self.eval_iters_now(state, final), self._iters_when_stopping())
        if self.max_time is None or self.eval_cost.window_seconds <= 0:
            return self.eval_iters
        left = self.max_time - self.time_used(state) - self.save_seconds - EXIT_SECONDS
        planned = self.planned_eval_iters()
        if final:
            return self.eval_cost.iters_within(left, planned)
        return planned if self.eval_cost.seconds(planned) <= left - self.reserve else 0

    def _iters_when_stopping(self) -> int:
        """The batches that fit in STOP_EVAL_SECONDS by the measured cost of a window or, without one, by
        the step time (a step costs STEP_FORWARDS forward passes of its windows); 0 before either is known."""
        window = self.eval_cost.window_seconds or self.step_seconds / (STEP_FORWARDS * self.step_windows)
        if window <= 0:
            return 0
        return replace(self.eval_cost, window_seconds=window).iters_within(STOP_EVAL_SECONDS, self.eval_iters)

    def shared(self) -> tuple[float, ...]:
        """What rank 0 measures and every rank must take, so that all decide alike (see `adopt`)."""
        return self.reserve, self.eval_cost.window_seconds, self.save_seconds

    def adopt(self, values: list[float]) -> None:
        self.reserve, self.eval_cost.window_seconds, self.save_seconds = values

    def describe(self) -> str:
        parts = []
        if self.max_iters is not None:
            parts.append(f"{self.max_iters:,} steps")
        if self.max_time is not None:
            since = f" from {format_seconds(self.time_from)} into the run" if self.time_from > 0 else ""
            parts.append(f"{format_seconds(self.max_time)} of wall time{since}")
        if self.max_tokens is not None:
            parts.append(f"{self.max_tokens:,} tokens")
        return " or ".join(parts)


def lr_at(cfg: TrainConfig, step: int, progress: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then the schedule from lr to min_lr over the budget's progress:
    cosine, or wsd (constant, then over the last `cooldown` of the budget 1 - sqrt of the cooldown's
    progress, or linear)."""
    assert cfg.lr is not None and cfg.min_lr is not None, "lr_at needs a resolved config (with_recipe)"
    if warmup and step < warmup:
        return cfg.lr * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "wsd":
        left = min(1.0, (1.0 - p) / cfg.cooldown)  # of the cooldown: 1 until it starts, 0 at the end
        if cfg.cooldown_shape == "sqrt":
            left = 1.0 - math.sqrt(1.0 - left)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * left
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * p))


def batch_at(cfg: TrainConfig, progress: float) -> int:
    """Sequences per micro-batch at this point of the budget: a quarter of batch_size growing linearly to
    all of it over the first `batch_ramp` of the budget (batch_size throughout when it is 0)."""
    assert cfg.batch_size is not None, "batch_at needs a resolved config (with_recipe)"
    return _ramp(cfg.batch_size, cfg.batch_ramp, progress)


def window_at(cfg: TrainConfig, block_size: int, progress: float) -> int:
    """Tokens per training window at this point of the budget: a quarter of block_size growing linearly
    to all of it over the first `seq_ramp` of the budget (block_size throughout when it is 0). Early steps
    learn what short contexts teach at a fraction of a long window's cost (attention's grows with its square)."""
    return _ramp(block_size, cfg.seq_ramp, progress)


def _ramp(full: int, fraction: float, progress: float) -> int:
    """A quarter of `full` (at least 1) growing linearly to all of it over the first `fraction` of the budget,
    in steps of a sixteenth of it: each new shape costs a compiled graph (torch.compile) or, on the CPU in
    bfloat16, kernels oneDNN builds and keeps (minigpt.chat.data.padded_width), so a ramp takes a dozen."""
    if fraction <= 0 or progress >= fraction:
        return full
    start = max(1, full // 4)
    value = start + math.floor((full - start) * progress / fraction)
    return max(start, value - value % max(1, full // 16))
