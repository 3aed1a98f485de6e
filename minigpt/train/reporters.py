"""How training tells its progress: the reporter protocol, a silent default, and plain lines for logs."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from minigpt.model.config import GPTConfig
from minigpt.runs.usage import generate_command

if TYPE_CHECKING:
    from minigpt.train.checkpoint import TrainState

NO_VALUE = "—"  # what a figure shows before there is one


@dataclass(frozen=True)
class TrainingStart:
    """What a reporter learns when training starts."""

    out: Path
    model: GPTConfig
    n_params: int
    tokenizer: str
    train_tokens: int
    val_tokens: int
    device: str
    dtype: str
    world_size: int
    batch_size: int
    grad_accum: int
    budget: str  # the budget in words
    start: TrainState  # where the run starts: step 0, or the resumed checkpoint's progress and best loss
    start_progress: float = 0.0  # the fraction of the budget used when this command started
    elapsed: float = 0.0  # the run's elapsed seconds at start(), this command's start-up included
    # while the corpus is still being tokenized beside training: how far that has come, in words
    data_status: Callable[[], str | None] | None = None
    data: str | None = None  # what the data is, where tokens say too little (conversations)
    fine_tune: str | None = None  # what a LoRA run trains
    machine: str | None = None  # the CPU settings measured on this machine (minigpt.train.tuning), in words


@dataclass(frozen=True)
class TrainingEnd:
    """What a reporter learns when training ends."""

    out: Path
    state: TrainState
    reason: str
    interrupted: bool
    elapsed: float  # the run's seconds over every command that trained it
    command_seconds: float  # this command's
    overrun: float  # seconds past the time budget (0: kept to it, or none)
    best_val_bpb: float | None
    history: list[dict[str, Any]]
    chat: bool = False  # trained on conversations: `minigpt chat` is the command to try it with
    prompt: str = ""  # what `minigpt generate` can start from (minigpt.runs.usage.example_prompt)
    best: str | None = None  # the best evaluation in words, where a loss and bits per byte do not say it


class ProgressReporter(Protocol):
    """Whoever shows a run's progress; the training loop calls these in order (on rank 0 only)."""

    # whether data preparation also shows its notes and progress bars (on stderr)
    data_progress: bool

    def log(self, message: str) -> None: ...

    def start(self, info: TrainingStart) -> None: ...

    def step(self, record: dict[str, Any], progress: float) -> None:
        """A logged step: record holds step, tokens, elapsed, loss and lr; progress is the budget fraction."""

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        """An evaluation: record holds step, tokens, elapsed, val_loss, train_loss, val_bpb and val_ppl."""

    def phase(self, what: str, done: int = 0, total: int = 0) -> None:
        """Work between steps (an evaluation, a save) and how far it is: `done` of `total` windows (total 0:
        not counted); an empty `what` when the run goes back to its steps."""

    def stop_requested(self, signal_name: str) -> None:
        """A signal asked the run to stop. Called from the signal handler, so it may only record what to
        show: writing there could re-enter a write the signal interrupted."""

    def finish(self, summary: TrainingEnd) -> None: ...

    def close(self) -> None:
        """The run ended without a summary (an error, or a second signal): take down any live display."""


class QuietReporter:
    """Reports nothing: the library's default."""

    data_progress = False

    def log(self, message: str) -> None:
        pass

    def start(self, info: TrainingStart) -> None:
        pass

    def step(self, record: dict[str, Any], progress: float) -> None:
        pass

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        pass

    def phase(self, what: str, done: int = 0, total: int = 0) -> None:
        pass

    def stop_requested(self, signal_name: str) -> None:
        pass

    def finish(self, summary: TrainingEnd) -> None:
        pass

    def close(self) -> None:
        pass


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return NO_VALUE
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_loss(value: float | None, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else NO_VALUE


class Pace:
    """Tokens per second and time left, measured over this command only (a resume starts afresh)."""

    def __init__(self, tokens: int, progress: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._t0 = self._t_last = self._t_eta = clock()
        self._p0 = progress
        self._tokens_last = tokens
        self.tokens_per_s = math.nan
        self._eta = math.inf

    def update(self, tokens: int, progress: float) -> None:
        now = self.clock()
        if tokens > self._tokens_last and now > self._t_last:
            self.tokens_per_s = (tokens - self._tokens_last) / (now - self._t_last)
        self._t_last, self._tokens_last = now, tokens
        done = progress - self._p0
        self._eta = (1 - progress) * (now - self._t0) / done if done > 0 else math.inf
        self._t_eta = now

    def restart(self) -> None:
        """Count tokens per second from now on: the time an evaluation and its save took is not a step's."""
        self._t_last = self.clock()

    def eta(self) -> float:
        """Seconds left, counted down from the last update."""
        return max(0.0, self._eta - (self.clock() - self._t_eta))

    def rate(self) -> str:
        return f"{self.tokens_per_s:,.0f} tok/s" if math.isfinite(self.tokens_per_s) else f"{NO_VALUE} tok/s"


def header_text(info: TrainingStart) -> str:
    m = info.model
    procs = f" × {info.world_size} processes" if info.world_size > 1 else ""
    so_far = " (so far: tokenizing goes on)" if info.data_status and info.data_status() else ""
    data = info.data or f"{info.train_tokens:,} train{so_far} / {info.val_tokens:,} val tokens"
    rows = "conversations of up to " if info.data else ""
    fine_tune = f"fine-tuning: {info.fine_tune}\n" if info.fine_tune else ""
    machine = f"on this machine: {info.machine}\n" if info.machine else ""
    return (
        f"model: {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, block {m.block_size}, "
        f"{info.n_params:,} parameters; tokenizer: {info.tokenizer}\n{fine_tune}"
        f"data: {data}; device: {info.device}{procs}, "
        f"{info.dtype}; batch {info.batch_size} × {info.grad_accum} × {rows}{m.block_size}\n"
        f"{machine}budget: {info.budget}\nwriting to {info.out}"
    )


def eval_figures(record: dict[str, Any]) -> str:
    """An evaluation's figures: RL's validation reward, DPO's preference accuracy and margin, or the
    language model's losses."""
    if "val_reward" in record:
        return f"val reward {fmt_loss(record['val_reward'])}"
    if "val_accuracy" in record:
        return (
            f"val pref acc {100 * record['val_accuracy']:.1f}% | margin {fmt_loss(record['val_margin'], 3)} | "
            f"val loss {fmt_loss(record['val_loss'])} | train loss {fmt_loss(record['train_loss'])}"
        )
    return (
        f"val loss {fmt_loss(record['val_loss'])} | val bpb {fmt_loss(record['val_bpb'], 3)} | "
        f"ppl {record['val_ppl']:.2f} | train loss {fmt_loss(record['train_loss'])}"
    )


def eval_line(record: dict[str, Any], improved: bool) -> str:
    mark = " (best, saved)" if improved else ""
    return f"eval  {record['step']:>6,} | {eval_figures(record)}{mark}"


def step_figures(record: dict[str, Any]) -> str:
    """A step's figures beside its loss: RL's mean reward, its spread and the KL to the starting model."""
    if "reward" not in record:
        return ""
    kl = f" | kl {record['kl']:.4f}" if "kl" in record else ""
    return f" | reward {record['reward']:.3f} ± {record['reward_std']:.3f}{kl}"


def done_text(summary: TrainingEnd) -> str:
    s = summary.state
    took = fmt_duration(summary.elapsed)
    if abs(summary.elapsed - summary.command_seconds) > 1:
        took += f" ({fmt_duration(summary.command_seconds)} in this command)"
    words = (
        summary.best or f"best val loss {fmt_loss(s.best_val_loss)} (bpb {fmt_loss(summary.best_val_bpb, 3)})"
    )
    best = (
        f"{words} at step {s.best_step:,}" if s.best_step >= 0 else "not evaluated (no time was left for it)"
    )
    lines = [
        f"{'interrupted' if summary.interrupted else 'done'}: {summary.reason} after {s.step:,} steps, "
        f"{s.tokens:,} tokens, {took}",
        f"{best}; saved in {summary.out}",
    ]
    if summary.overrun >= 0.05:
        lines.append(
            f"over budget: the run took {summary.overrun:.1f} s more than its max_time (start-up, the last "
            f"step or the final evaluation and save took longer than estimated)"
        )
    if summary.interrupted:
        lines.append(f"resume with: minigpt train --resume {summary.out}")
    elif summary.chat:
        lines.append(f"chat with: minigpt chat {summary.out}")
    else:
        lines.append(f"generate with: {generate_command(summary.out, summary.prompt)}")
    return "\n".join(lines)


class LineReporter(QuietReporter):
    """Plain lines on a stream (stderr by default): for logs and CI, and for library users who want them.

    Phases and a stop request show nothing here: a log gets an evaluation's line when it is done, and the
    line the loop logs as a stop's evaluation and save begin."""

    data_progress = True

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.stream = stream
        self.clock = clock
        self.pace = Pace(0, 0.0, clock)

    def log(self, message: str) -> None:
        print(message, file=self.stream or sys.stderr, flush=True)

    def start(self, info: TrainingStart) -> None:
        self.pace = Pace(info.start.tokens, info.start_progress, self.clock)
        self.log(header_text(info))

    def step(self, record: dict[str, Any], progress: float) -> None:
        self.pace.update(record["tokens"], progress)
        self.log(
            f"step {record['step']:>6,} | loss {fmt_loss(record['loss'])} | lr {record['lr']:.2e}"
            f"{step_figures(record)} | {self.pace.rate()} | {fmt_duration(record['elapsed'])} elapsed, "
            f"ETA {fmt_duration(self.pace.eta())}"
        )

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        self.pace.restart()
        self.log(eval_line(record, improved))

    def finish(self, summary: TrainingEnd) -> None:
        self.log(done_text(summary))
