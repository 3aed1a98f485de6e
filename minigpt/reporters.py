"""How training tells its progress: the reporter protocol, a silent default, and plain lines for logs."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from minigpt.config import GPTConfig

if TYPE_CHECKING:
    from minigpt.trainstate import TrainState


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


@dataclass(frozen=True)
class TrainingEnd:
    """What a reporter learns when training ends."""

    out: Path
    state: TrainState
    reason: str
    interrupted: bool
    command_seconds: float
    best_val_bpb: float
    history: list[dict[str, Any]]


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

    def finish(self, summary: TrainingEnd) -> None: ...


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

    def finish(self, summary: TrainingEnd) -> None:
        pass


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def header_text(info: TrainingStart) -> str:
    m = info.model
    procs = f" × {info.world_size} processes" if info.world_size > 1 else ""
    return (
        f"model: {m.n_layer} layers, {m.n_head} heads, {m.n_embd} wide, block {m.block_size}, "
        f"{info.n_params:,} parameters; tokenizer: {info.tokenizer}\n"
        f"data: {info.train_tokens:,} train / {info.val_tokens:,} val tokens; device: {info.device}{procs}, "
        f"{info.dtype}; batch {info.batch_size} × {info.grad_accum} × {m.block_size}; budget: {info.budget}\n"
        f"writing to {info.out}"
    )


def eval_line(record: dict[str, Any], improved: bool) -> str:
    mark = " (best, saved)" if improved else ""
    return (
        f"eval  {record['step']:>6,} | val loss {record['val_loss']:.4f} | val bpb {record['val_bpb']:.3f} | "
        f"ppl {record['val_ppl']:.2f} | train loss {record['train_loss']:.4f}{mark}"
    )


def done_text(summary: TrainingEnd) -> str:
    s = summary.state
    lines = [
        f"{'interrupted' if summary.interrupted else 'done'}: {summary.reason} after {s.step:,} steps, "
        f"{s.tokens:,} tokens, {fmt_duration(summary.command_seconds)}",
        f"best val loss {s.best_val_loss:.4f} (bpb {summary.best_val_bpb:.3f}) at step {s.best_step:,}; "
        f"saved in {summary.out}",
    ]
    if summary.interrupted:
        lines.append(f"resume with: minigpt train --resume {summary.out}")
    else:
        lines.append(f'generate with: minigpt generate --model {summary.out} "Once upon a time"')
    return "\n".join(lines)


class LineReporter:
    """Plain lines on a stream (stderr by default): for logs and CI, and for library users who want them."""

    data_progress = True

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.tokens_per_s = 0.0
        self._t_last: float | None = None
        self._tokens_last = 0

    def log(self, message: str) -> None:
        print(message, file=self.stream or sys.stderr, flush=True)

    def start(self, info: TrainingStart) -> None:
        self.log(header_text(info))
        self._t_last = time.perf_counter()

    def _measure_rate(self, tokens: int) -> None:
        now = time.perf_counter()
        if self._t_last is not None and tokens > self._tokens_last and now > self._t_last:
            self.tokens_per_s = (tokens - self._tokens_last) / (now - self._t_last)
        self._t_last, self._tokens_last = now, tokens

    def step(self, record: dict[str, Any], progress: float) -> None:
        self._measure_rate(record["tokens"])
        eta = record["elapsed"] / progress * (1 - progress) if progress > 0 else math.inf
        self.log(
            f"step {record['step']:>6,} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"{self.tokens_per_s:,.0f} tok/s | {fmt_duration(record['elapsed'])} elapsed, ETA {fmt_duration(eta)}"
        )

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        self.log(eval_line(record, improved))

    def finish(self, summary: TrainingEnd) -> None:
        self.log(done_text(summary))
