"""A training budget: how far along a run is, when it stops, the time it keeps for the end, and the lr."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minigpt.trainconfig import TrainConfig, format_seconds

if TYPE_CHECKING:
    from minigpt.trainstate import TrainState


@dataclass
class Budget:
    """The first of max_iters, max_time and max_tokens reached stops the run; each counts over the whole
    run, so a resume carries the steps, tokens and time already spent."""

    max_iters: int | None = None
    max_time: float | None = None  # seconds
    max_tokens: int | None = None
    # seconds kept at the end of a time budget for the final evaluation and save
    reserve: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    origin: float = 0.0  # clock reading at which the run's elapsed time was 0

    @classmethod
    def of(cls, cfg: TrainConfig, clock: Callable[[], float] = time.perf_counter) -> Budget:
        return cls(cfg.max_iters, cfg.max_time, cfg.max_tokens, clock=clock)

    def start(self, started: float | None, elapsed: float) -> None:
        """Count the run's elapsed time on from `elapsed` seconds at clock reading `started` (None: now)."""
        self.origin = (self.clock() if started is None else started) - elapsed

    def elapsed(self) -> float:
        return self.clock() - self.origin

    def progress(self, state: TrainState) -> float:
        """Fraction of the budget used, in [0, 1]: the largest of steps, time and tokens. The time kept for
        the final evaluation does not count, so a schedule ends when training does."""
        parts = [0.0]
        if self.max_iters is not None:
            parts.append(state.step / self.max_iters)
        if self.max_time is not None:
            parts.append(state.elapsed / max(self.max_time - self.reserve, 1e-9))
        if self.max_tokens is not None:
            parts.append(state.tokens / self.max_tokens)
        return min(max(parts), 1.0)

    def stop_reason(self, state: TrainState) -> str | None:
        """Why the run stops before another step, or None."""
        if self.max_iters is not None and state.step >= self.max_iters:
            return f"reached max_iters {self.max_iters:,}"
        if self.max_time is not None and state.elapsed + self.reserve >= self.max_time:
            return f"reached max_time {format_seconds(self.max_time)}"
        if self.max_tokens is not None and state.tokens >= self.max_tokens:
            return f"reached max_tokens {self.max_tokens:,}"
        return None

    def describe(self) -> str:
        parts = []
        if self.max_iters is not None:
            parts.append(f"{self.max_iters:,} steps")
        if self.max_time is not None:
            parts.append(f"{format_seconds(self.max_time)} of wall time")
        if self.max_tokens is not None:
            parts.append(f"{self.max_tokens:,} tokens")
        return " or ".join(parts)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup` steps, then the schedule from lr to min_lr over the budget's progress:
    cosine, or wsd (constant, then linear over the last `cooldown` of the budget)."""
    assert cfg.lr is not None and cfg.min_lr is not None, "lr_at needs a resolved config (with_recipe)"
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "wsd":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * min(1.0, (1.0 - p) / cfg.cooldown)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * p))
