"""The CLI's training progress: a live display on a terminal, plain lines in logs, loss curves at the end."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from minigpt.train.reporters import (
    NO_VALUE,
    LineReporter,
    TrainingEnd,
    TrainingStart,
    eval_figures,
    eval_line,
    fmt_duration,
    fmt_loss,
    step_figures,
)

BAR_WIDTH = 30  # the bar and its figures fit 80 columns


def line_chart(series: dict[str, list[tuple[float, float]]], width: int = 64, height: int = 12) -> Text:
    """A small terminal chart of y against x for a few named series (e.g. train and val loss)."""
    styles = ["cyan", "magenta", "yellow", "green"]
    marks = ["•", "◆", "▲", "■"]
    points = [(x, y) for pts in series.values() for x, y in pts if math.isfinite(y)]
    out = Text()
    if len(points) < 2:
        return out
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y1 = y0 + 1e-9
    if x1 - x0 < 1e-9:
        x1 = x0 + 1
    grid: list[list[tuple[str, str] | None]] = [[None] * width for _ in range(height)]
    for i, pts in enumerate(series.values()):
        for x, y in pts:
            if not math.isfinite(y):
                continue
            col = round((x - x0) / (x1 - x0) * (width - 1))
            row = height - 1 - round((y - y0) / (y1 - y0) * (height - 1))
            grid[row][col] = (marks[i % len(marks)], styles[i % len(styles)])
    label_w = max(len(f"{y1:.3f}"), len(f"{y0:.3f}"))
    for r, row in enumerate(grid):
        y_label = f"{y1:.3f}" if r == 0 else f"{y0:.3f}" if r == height - 1 else ""
        out.append(f"{y_label:>{label_w}} │", style="dim")
        for cell in row:
            out.append(cell[0], style=cell[1]) if cell else out.append(" ")
        out.append("\n")
    out.append(" " * label_w + " └" + "─" * width + "\n", style="dim")
    left, right = f"{x0:,.0f}", f"{x1:,.0f}"
    out.append(
        " " * (label_w + 2) + left + " " * max(1, width - len(left) - len(right)) + right + "  step\n",
        style="dim",
    )
    legend = "   ".join(f"{marks[i % len(marks)]} {name}" for i, name in enumerate(series))
    out.append(" " * (label_w + 2) + legend + "\n")
    return out


def curves(history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """The run's curves against the step: RL's reward (each logged step's, and the validation's), else the
    step and validation losses."""
    figure = "reward" if any("reward" in r for r in history) else "loss"
    train = [(r["step"], r[figure]) for r in history if r.get("kind") == "train" and figure in r]
    val = [
        (r["step"], r[f"val_{figure}"]) for r in history if r.get("kind") == "eval" and f"val_{figure}" in r
    ]
    return {f"step {figure}": train, f"val {figure}": val}


class TrainingDisplay(LineReporter):
    """On a terminal, a live display redrawn 4 times a second (elapsed time and ETA tick between steps) with
    evaluation lines above it; elsewhere LineReporter's plain lines. Both end with the loss curves.

    The display also shows what the run does between steps (an evaluation, counted in windows; a save) and,
    from the moment a signal asks the run to stop, that it is stopping."""

    def __init__(
        self,
        console: Console | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(clock=clock)
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.live_mode = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self._step: dict[str, Any] = {}
        self._eval: dict[str, Any] = {}
        self._best = (math.inf, -1)
        self._progress = 0.0
        self._budget = ""
        self._started, self._elapsed0 = clock(), 0.0
        self._data_status: Callable[[], str | None] | None = None
        self._stopping: str | None = None  # the signal that asked the run to stop
        self._phase: tuple[str, int, int] | None = None  # what, done, total

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False)

    def start(self, info: TrainingStart) -> None:
        super().start(info)
        self._budget = info.budget
        self._best = (info.start.best_val_loss, info.start.best_step)
        self._eval = dict(info.start.last_eval)
        self._progress = info.start_progress
        self._started, self._elapsed0 = self.clock(), info.elapsed
        self._data_status = info.data_status
        if self.live_mode:
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def __rich__(self) -> Group:
        """Rendered on every refresh, so the clock figures move between steps."""
        return self.render()

    def render(self) -> Group:
        elapsed = self._elapsed0 + self.clock() - self._started
        s, e = self._step, self._eval
        best_loss, best_step = self._best
        best = f"{fmt_loss(best_loss)} at step {best_step:,}" if best_step >= 0 else NO_VALUE
        lr = f"{s['lr']:.2e}" if "lr" in s else NO_VALUE
        head = Table.grid(padding=(0, 1))
        head.add_row(
            ProgressBar(total=1.0, completed=min(self._progress, 1.0), width=BAR_WIDTH),
            Text(f"{100 * min(self._progress, 1):5.1f}%  step {s.get('step', 0):,}", no_wrap=True),
        )
        eta = "stopping" if self._stopping else f"ETA {fmt_duration(self.pace.eta())}"
        last = f"val loss {fmt_loss(e.get('val_loss'))}  train loss {fmt_loss(e.get('train_loss'))}"
        if "val_reward" in e or "val_accuracy" in e:  # RL's or DPO's figures
            last = eval_figures(e).replace(" | ", "  ")
        lines = [
            f"elapsed {fmt_duration(elapsed)}  {eta}  budget: {self._budget}",
            f"step loss {fmt_loss(s.get('loss'))}{step_figures(s).replace(' | ', '  ')}  lr {lr}  {self.pace.rate()}",
            f"{last}  best val {best}",
        ]
        corpus = self._data_status() if self._data_status is not None else None
        if corpus:
            lines.append(f"corpus {corpus}")
        rows = [Text(line, no_wrap=True, overflow="ellipsis") for line in lines]
        return Group(head, *rows, *self._phase_rows())

    def _phase_rows(self) -> list[Any]:
        """What the run does between steps, with a bar where it is counted; a stop says so at once."""
        stop = f"stopping ({self._stopping}): " if self._stopping else ""
        if self._phase is None:
            if not stop:
                return []
            return [Text(f"{stop}ending the current step, then evaluating and saving…", style="bold")]
        what, done, total = self._phase
        label = Text(f"{stop}{what}…", style="bold" if stop else "", no_wrap=True, overflow="ellipsis")
        if not total:
            return [label]
        row = Table.grid(padding=(0, 1))
        row.add_row(
            label,
            ProgressBar(total=total, completed=done, width=BAR_WIDTH // 2),
            f"{done:,}/{total:,} windows",
        )
        return [row]

    def step(self, record: dict[str, Any], progress: float) -> None:
        self._step, self._progress = record, progress
        if self._live is None:
            super().step(record, progress)
        else:
            self.pace.update(record["tokens"], progress)

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        self._eval = record
        self.pace.restart()
        if improved:
            self._best = (record["val_loss"], record["step"])
        self.log(eval_line(record, improved))

    def phase(self, what: str, done: int = 0, total: int = 0) -> None:
        self._phase = (what, done, total) if what else None

    def stop_requested(self, signal_name: str) -> None:
        self._stopping = signal_name  # drawn by the display's own refresh, never from the signal handler

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finish(self, summary: TrainingEnd) -> None:
        self.close()
        chart = line_chart(curves(summary.history))
        if chart.plain:
            self.console.print(chart)
        super().finish(summary)
