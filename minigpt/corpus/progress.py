"""Progress of long phases (data preparation, scoring, exports): on a terminal a rich bar, or a spinner for
work that cannot be counted, redrawn several times a second; in a log a plain line at least every 10 s."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

LOG_INTERVAL = 10.0  # seconds between plain progress lines, at most
BYTES = "bytes"  # a Meter's unit when it counts bytes (sizes and speeds are shown); any other is a noun


def text_size(n: float) -> str:
    """47 KB, 1.1 MB, 2.3 GB: a size a person reads at a glance (0.0 MB for 47 KB said nothing)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:,.0f} {unit}"
    return f"{int(n):,} bytes"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Meter:
    """Units done of a total (bytes, or things named by `unit`; a total of 0: not counted), safe to advance
    from several threads; its status in words."""

    def __init__(self, description: str, total: int, clock: Callable[[], float], unit: str = BYTES) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self.on_advance: Callable[[int], None] | None = None

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
        if self.on_advance is not None:
            self.on_advance(n)

    def rate(self) -> float:
        """Bytes per second so far."""
        seconds = self.clock() - self.started
        return self.done / seconds if seconds > 0 else math.nan

    def status(self) -> str:
        """'tokenizing: 120 MB of 1.0 GB (12%), 10.3 MB/s, 1:23 left', 'scoring: 120 of 1,000 windows
        (12%), 1:23 left', or for work not counted 'writing model.safetensors: 0:12 so far'."""
        if not self.total:
            return f"{self.description}: {_duration(self.clock() - self.started)} so far"
        rate = self.rate()
        left = (self.total - self.done) / rate if rate > 0 else math.inf
        share = f" ({100 * self.done / self.total:.0f}%)"
        if self.unit != BYTES:
            return f"{self.description}: {self.done:,} of {self.total:,} {self.unit}{share}, {_duration(left)} left"
        speed = f"{rate / 1e6:.1f} MB/s" if math.isfinite(rate) else "— MB/s"
        return (
            f"{self.description}: {text_size(self.done)} of {text_size(self.total)}{share}, {speed}, "
            f"{_duration(left)} left"
        )


class Progress:
    """Notes and byte-counted phases on stderr: a bar on a terminal, plain lines elsewhere, or nothing."""

    def __init__(
        self,
        enabled: bool,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL,
    ) -> None:
        self.enabled = enabled
        self.stream = stream
        self.clock = clock
        self.interval = interval
        self._terminal = terminal

    @property
    def terminal(self) -> bool:
        if self._terminal is None:
            self._terminal = bool(getattr(self.stream or sys.stderr, "isatty", lambda: False)())
        return self._terminal

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream or sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, description: str, total: int = 0, bar: bool = True, unit: str = BYTES) -> Iterator[Meter]:
        """A Meter for the phase (of `total` units; 0: a phase that cannot be counted): on a terminal a rich
        bar follows it, a spinner and the time so far when it is not counted (without `bar`, the caller shows
        it), in a log a plain line is printed every `interval` seconds while it runs (none if it is shorter)."""
        meter = Meter(description, total, self.clock, unit)
        if not self.enabled or (self.terminal and not bar):  # the caller shows the meter (a live display)
            yield meter
        elif self.terminal:
            with self._bar(meter):
                yield meter
        else:
            with LogTicker(meter, self.note, self.interval):
                yield meter

    @contextlib.contextmanager
    def _bar(self, meter: Meter) -> Iterator[None]:
        from rich.console import Console
        from rich.progress import Progress

        console = Console(file=self.stream or sys.stderr, force_terminal=True)
        with Progress(*_columns(meter), console=console, transient=True) as bar:
            task = bar.add_task(meter.description, total=meter.total or None)
            meter.on_advance = lambda n: bar.advance(task, n)
            yield


def _columns(meter: Meter) -> tuple[Any, ...]:
    """A bar's columns: sizes and speed for bytes, a count of the unit for other things, a spinner and the
    time so far for work that is not counted."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    name = TextColumn("{task.description}")
    if not meter.total:
        return SpinnerColumn(), name, TimeElapsedColumn()
    if meter.unit != BYTES:
        return name, BarColumn(), MofNCompleteColumn(), TextColumn(meter.unit), TimeRemainingColumn()
    return name, BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()


QUIET = Progress(False)  # shows nothing: the default of library calls that can show progress


class LogTicker:
    """Prints a meter's status every `interval` seconds from a thread of its own, so a phase that reports
    nothing for a while (a tokenizer merging its pairs) still shows it is alive."""

    def __init__(self, meter: Meter, emit: Callable[[str], None], interval: float) -> None:
        self.meter = meter
        self.emit = emit
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="minigpt-progress")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.emit(self.meter.status())

    def __enter__(self) -> LogTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
