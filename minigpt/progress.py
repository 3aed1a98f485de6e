"""Training progress on stderr: a rich live panel on a terminal, plain lines in logs, a summary with curves."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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


class Reporter:
    """Shows training progress on stderr; `enabled=False` (non-zero ranks) silences it."""

    def __init__(
        self, enabled: bool = True, live: bool | None = None, console: Console | None = None
    ) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.live_mode = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self._last_step: dict[str, Any] = {}
        self._last_eval: dict[str, Any] = {}
        self._best: tuple[float, int] | None = None
        self._progress = 0.0
        self._tok_s = 0.0
        self._t_last: float | None = None
        self._tokens_last = 0
        self._budget = ""

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)

    def start(
        self,
        cfg: Any,
        model_config: Any,
        n_params: int,
        tokenizer: str,
        dataset: Any,
        device: Any,
        dtype: Any,
        out: Any,
        world_size: int = 1,
    ) -> None:
        budget = []
        if cfg.max_iters is not None:
            budget.append(f"{cfg.max_iters:,} steps")
        if cfg.max_time is not None:
            budget.append(f"{fmt_duration(cfg.max_time)} of time")
        if cfg.max_tokens is not None:
            budget.append(f"{cfg.max_tokens:,} tokens")
        self._budget = " or ".join(budget)
        procs = f" × {world_size} processes" if world_size > 1 else ""
        self.log(
            f"model: {model_config.n_layer} layers, {model_config.n_head} heads, {model_config.n_embd} wide, "
            f"block {model_config.block_size}, {n_params:,} parameters; tokenizer: {tokenizer}\n"
            f"data: {len(dataset.train):,} train / {len(dataset.val):,} val tokens; device: {device}{procs}, "
            f"{str(dtype).removeprefix('torch.')}; batch {cfg.batch_size} × {cfg.grad_accum} × {model_config.block_size}; "
            f"budget: {self._budget}\nwriting to {out}"
        )
        if self.enabled and self.live_mode:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()
        self._t_last = time.perf_counter()

    def _render(self) -> Group:
        s, e = self._last_step, self._last_eval
        elapsed = s.get("elapsed", 0.0)
        eta = elapsed / self._progress * (1 - self._progress) if self._progress > 0 else math.inf
        bar = ProgressBar(total=1.0, completed=min(self._progress, 1.0), width=40)
        head = Text(
            f" {100 * min(self._progress, 1):5.1f}%  step {s.get('step', 0):,}  "
            f"{fmt_duration(elapsed)} elapsed, ETA {fmt_duration(eta)}  (budget: {self._budget})"
        )
        table = Table.grid(padding=(0, 3))
        table.add_row(
            f"train loss {s.get('loss', math.nan):.4f}",
            f"val loss {e.get('val_loss', math.nan):.4f}",
            f"val bpb {e.get('val_bpb', math.nan):.3f}",
            f"lr {s.get('lr', 0.0):.2e}",
            f"{self._tok_s:,.0f} tok/s",
        )
        row = Table.grid()
        row.add_row(bar, head)
        return Group(row, table)

    def step(self, record: dict[str, Any], progress: float, tokens_per_step: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._t_last is not None and record["tokens"] > self._tokens_last:
            dt = now - self._t_last
            if dt > 0:
                self._tok_s = (record["tokens"] - self._tokens_last) / dt
        self._t_last, self._tokens_last = now, record["tokens"]
        self._last_step, self._progress = record, progress
        if self._live is not None:
            self._live.update(self._render())
        else:
            eta = record["elapsed"] / progress * (1 - progress) if progress > 0 else math.inf
            self.log(
                f"step {record['step']:>6,} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"{self._tok_s:,.0f} tok/s | {fmt_duration(record['elapsed'])} elapsed, ETA {fmt_duration(eta)}"
            )

    def evaluated(self, record: dict[str, Any], improved: bool) -> None:
        if not self.enabled:
            return
        self._last_eval = record
        mark = " (best, saved)" if improved else ""
        if self._live is not None:
            self._live.update(self._render())
            self._live.console.print(
                f"eval step {record['step']:,}: val loss {record['val_loss']:.4f}, bpb {record['val_bpb']:.3f}, "
                f"train loss {record['train_loss']:.4f}{mark}",
                highlight=False,
            )
        else:
            self.log(
                f"eval  {record['step']:>6,} | val loss {record['val_loss']:.4f} | val bpb {record['val_bpb']:.3f} | "
                f"ppl {record['val_ppl']:.2f} | train loss {record['train_loss']:.4f}{mark}"
            )

    def finish(
        self,
        history: list[dict[str, Any]],
        state: Any,
        out: Any,
        reason: str,
        interrupted: bool,
        total_seconds: float,
        dataset: Any,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if not self.enabled:
            return
        train_pts = [(r["step"], r["loss"]) for r in history if r.get("kind") == "train"]
        val_pts = [(r["step"], r["val_loss"]) for r in history if r.get("kind") == "eval"]
        chart = line_chart({"train loss": train_pts, "val loss": val_pts})
        if chart.plain:
            self.console.print(chart)
        from minigpt.data import bits_per_byte

        best_bpb = bits_per_byte(state.best_val_loss, len(dataset.val), dataset.val_bytes)
        self.log(
            f"{'interrupted' if interrupted else 'done'}: {reason} after {state.step:,} steps, "
            f"{state.tokens:,} tokens, {fmt_duration(total_seconds)}\n"
            f"best val loss {state.best_val_loss:.4f} (bpb {best_bpb:.3f}) at step {state.best_step:,}; saved in {out}"
        )
        if interrupted:
            self.log(f"resume with: minigpt train --resume {out}")
        else:
            self.log(f'generate with: minigpt generate --model {out} "Once upon a time"')
