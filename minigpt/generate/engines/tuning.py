"""Choices a decoding engine makes by measuring on this machine: its weights' layout and its threads.

Layout: `best_times` times alternatives (the same step over weights in each layout) round robin. The
answer depends on the CPU, the BLAS library and the model's shapes, not on the moment, so `remembered`
keeps each layout's best time per machine and shape in the cache directory ($MINIGPT_CACHE_DIR, else
~/.cache/minigpt, as for token caches): the first three loads on a machine measure, later loads read the
answer.

Threads: measured on the steps themselves, not fixed.

A decoding step streams every weight through matrix-vector products, between a few hundred small
operations. More threads stream faster while the memory has bandwidth to spare and the cores are free; on
a machine whose cores other work holds, each of those operations waits for its slowest thread, and two
threads can be several times slower than one. The best count depends on the CPU, the model, the number of
rows and the load of the moment, so the engine measures it: for each number of rows, its first steps (and
separately its first prefills, per token) run on each candidate count in turn (`trials` each, a count
more than 1.5 times slower than the best dropped after its first step), the count with the lowest median
time is kept, and the trial runs again after 25 steps, then 50, 100... up to every `every` steps, so a
change of load is followed, and a choice made in a moment of load (three steps each) is soon looked at
again rather than kept for the rest of a run it no longer fits. A trial step is a real step: measuring
costs no start-up time, only the difference between the counts over a few steps. The first pass of a
kind runs on the smallest count, one thread: on a busy machine a first pass on every core can wait on
every core's other work.

A thread count named in the environment (OMP_NUM_THREADS, or the BLAS library's own variable) is used
as given, untried.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from minigpt.common.files import atomic_write_json, read_bounded
from minigpt.common.strict_json import parse_json
from minigpt.errors import MinigptError, UsageError
from minigpt.model.weights import expected_shapes

if TYPE_CHECKING:
    from minigpt.model.config import GPTConfig

W = TypeVar("W")

__all__ = [
    "BLAS_ENV",
    "TORCH_ENV",
    "ThreadTuner",
    "blas_tuner",
    "measuring_blocked",
    "cores",
    "env_threads",
    "best_times",
    "model_key",
    "pick_layout",
    "remembered",
    "remembered_times",
    "thread_candidates",
]


def best_times(
    runs: Mapping[str, Callable[[], object]],
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    prepare: Callable[[str], object] | None = None,
) -> dict[str, float]:
    """Each run's best time: each is called once untimed (first touches), then `rounds` times, round
    robin so that every one sees the same moments of load, each call after `prepare(name)`, untimed,
    where given. The best, as STREAM takes it: other work on the machine only ever slows a run down."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 1):
        for name, run in runs.items():
            if prepare is not None:
                prepare(name)
            start = clock()
            run()
            if round_:
                times[name].append(clock() - start)
    return {name: min(t) for name, t in times.items()}


def cache_file() -> Path:
    """Where measured choices are kept: tuning.json in the cache directory (minigpt.data.dataset's rule)."""
    env = os.environ.get("MINIGPT_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "minigpt") / "tuning.json"


def machine() -> str:
    """This CPU as a cache key: its model name and the cores this process may use."""
    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    # only where /proc has no name: on Linux platform.processor() runs `uname -p`, a subprocess at start-up
    return f"{name or platform.processor() or platform.machine()}, {cores()} cores"


def remembered(
    key: Mapping[str, object],
    choices: Sequence[str],
    measure: Callable[[], Mapping[str, float]],
    measurements: int = 3,
) -> str:
    """The fastest of `choices` for `key` (with this machine added), from `remembered_times`."""
    best = remembered_times(key, choices, measure, measurements)
    return min(choices, key=lambda c: best[c])


def remembered_times(
    key: Mapping[str, object],
    choices: Sequence[str],
    measure: Callable[[], Mapping[str, float]],
    measurements: int = 3,
) -> dict[str, float]:
    """Each of `choices`' best time for `key` (with this machine added): each of the first `measurements`
    calls runs `measure()` (every choice's time) and keeps every choice's best time over all of them in
    the cache file; later calls read them. A measurement taken while other work held the machine is
    slower, never faster, so the bests converge on a quiet moment's. A missing, damaged or unwritable
    cache only means measuring again."""
    path = cache_file()
    name = json.dumps({"machine": machine(), **key}, sort_keys=True)
    stored: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, MinigptError):
        loaded = parse_json(read_bounded(path))
        stored = loaded if isinstance(loaded, dict) else {}
    entry = stored.get(name)
    best: dict[str, float] = {}
    count = 0
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("best"), dict)
        and isinstance(entry.get("count"), int)
    ):
        best = {
            c: t for c, t in entry["best"].items() if c in choices and isinstance(t, (int, float)) and t > 0
        }
        count = entry["count"] if set(best) == set(choices) else 0
    if count < measurements:
        times = measure()
        best = {c: min(times[c], best.get(c, math.inf)) for c in choices}
        with contextlib.suppress(OSError, MinigptError):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {**stored, name: {"best": best, "count": count + 1}})
    return best


def model_key(config: GPTConfig) -> list[object]:
    """What a layout's speed depends on in a model: its matrices' shapes and how many layers repeat them."""
    shapes = {shape for shape in expected_shapes(config).values() if len(shape) == 2}
    return [config.n_layer, sorted(shapes)]


def pick_layout(
    requested: str,
    forms: Mapping[str, Callable[[], W]],
    times_of: Callable[[dict[str, W]], Mapping[str, float]],
    key: Mapping[str, object],
    can_measure: bool = True,
) -> tuple[str, W]:
    """The layout and weights a loading engine keeps: the form `requested` names, or for 'auto' the fastest
    of `forms` (each built only when needed), as `remembered` keeps it for `key` on this machine from
    the best times `times_of` measures on all of them. Without `can_measure` (no room for two copies, or no
    CPU clock to trust), 'auto' is the first form."""
    built: dict[str, W] = {}

    def make(name: str) -> W:
        if name not in built:
            built[name] = forms[name]()
        return built[name]

    if requested == "auto":
        first = next(iter(forms))
        if not can_measure or len(forms) == 1:
            requested = first
        else:
            requested = remembered(key, list(forms), lambda: times_of({name: make(name) for name in forms}))
    if requested not in forms:
        raise UsageError(f"unknown layout {requested!r} here: choose one of auto, {', '.join(forms)}")
    return requested, make(requested)


def cores() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


# "off": training measures nothing (runs that must match across machines); "on": it measures however busy
# the machine is (the load is the user's own, or a smoke test must see the measuring path)
MEASURE_ENV = "MINIGPT_MEASURE"


def measuring_blocked(share: float = 0.5) -> str | None:
    """Why training should not measure now (None: it may): MINIGPT_MEASURE=off, or a load average over
    `share` of the cores, where a measurement would time other work more than its own choices, unless
    MINIGPT_MEASURE=on."""
    setting = os.environ.get(MEASURE_ENV, "").lower()
    if setting == "off":
        return f"{MEASURE_ENV}=off"
    if setting == "on" or not hasattr(os, "getloadavg"):
        return None
    load, available = os.getloadavg()[0], cores()
    if load > share * available:
        return f"the machine is busy (load {load:.1f} on {available} cores); measured at a quieter start"
    return None


def thread_candidates(available: int) -> list[int]:
    """1, 2, 4, ... up to the available cores, and the core count itself."""
    counts, n = [], 1
    while n < available:
        counts.append(n)
        n *= 2
    return [*counts, available]


def env_threads(names: Sequence[str]) -> int | None:
    """The thread count the first of these environment variables sets (a positive integer), else None."""
    for name in names:
        value = os.environ.get(name, "").strip().split(",")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


class _Trial:
    """Steps of one number of rows: the timings of the candidates still in the running, and the count chosen.

    A candidate whose fastest step is more than PRUNE times the fastest of all leaves the trial at once:
    on a busy machine a count that loses loses by several times, and three such steps would cost more
    than the trial can win. With a `margin` above 1 the count already chosen stays unless another's median
    beats its own by that factor (noise alone does not switch); with a `slowdown`, a chosen count whose
    last SLOW_STEPS steps each took that many times its median in the trial is tried again at once, not
    at the next look (other work has taken a core).
    """

    PRUNE = 1.5
    SLOW_STEPS = 3

    def __init__(self, candidates: Sequence[int], first_look: int) -> None:
        self.candidates = candidates
        self.times: dict[int, list[float]] = {n: [] for n in candidates}
        self.chosen: int | None = None
        self.pace = math.inf  # the chosen count's median step in its trial
        self.slow = 0  # steps in a row slower than `slowdown` times the pace
        self.since = 0  # steps since the count was chosen
        self.look = first_look  # steps until the next trial: doubles after each, up to `every`

    @property
    def trying(self) -> bool:
        return bool(self.times)

    def next(self) -> int:
        if not self.trying:
            assert self.chosen is not None
            return self.chosen
        # round robin: every candidate sees the same moments of load
        return min(self.times, key=lambda n: len(self.times[n]))

    def record(self, threads: int, seconds: float, tuner: ThreadTuner) -> None:
        if not self.trying:
            self.since += 1
            slowed = tuner.slowdown is not None and seconds > tuner.slowdown * self.pace
            self.slow = self.slow + 1 if slowed else 0
            if self.since >= min(self.look, tuner.every) or self.slow >= self.SLOW_STEPS:  # look again
                self.times, self.look = {n: [] for n in self.candidates}, 2 * self.look
            return
        self.times[threads].append(seconds)
        if all(self.times.values()):
            best = min(min(t) for t in self.times.values())
            self.times = {n: t for n, t in self.times.items() if min(t) <= self.PRUNE * best}
        if len(self.times) == 1 or all(len(t) >= tuner.trials for t in self.times.values()):
            medians = {n: statistics.median(t) for n, t in self.times.items()}
            fastest = min(medians, key=lambda n: medians[n])
            kept = self.chosen in medians and medians[fastest] * tuner.margin >= medians[self.chosen]
            self.chosen = self.chosen if kept else fastest
            self.pace = medians[self.chosen]
            self.times, self.since, self.slow = {}, 0, 0


class ThreadTuner:
    """Picks the thread count of each forward pass from the timings of earlier passes of its kind.

    `get_threads` and `set_threads` read and switch the backend's thread pool, which belongs to the whole
    process (another engine may have switched it); `clock` is injectable so tests can fake time. Use
    `with tuner.step(rows): <one forward pass>`.
    """

    def __init__(
        self,
        get_threads: Callable[[], int],
        set_threads: Callable[[int], None],
        candidates: Sequence[int],
        *,
        trials: int = 3,
        every: int = 500,
        first_look: int = 25,
        margin: float = 1.0,
        slowdown: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not candidates:
            raise ValueError("no thread counts to choose from")
        self.candidates = list(candidates)
        self.trials = trials
        self.every = every
        self.first_look = first_look
        self.margin = margin  # and slowdown: see _Trial
        self.slowdown = slowdown
        self._get, self._set = get_threads, set_threads
        self._clock = clock
        self._by_key: dict[Hashable, _Trial] = {}
        self.last = self.candidates[0]  # the count the latest pass ran on

    def chosen(self, key: Hashable) -> int | None:
        """The count chosen for steps of this kind (None until their first trial has finished)."""
        if len(self.candidates) == 1:
            return self.candidates[0]
        trial = self._by_key.get(key)
        return None if trial is None else trial.chosen

    def use(self, threads: int) -> None:
        """Switch the backend to `threads` threads (nothing to do when it runs on that many already)."""
        if threads != self._get():
            self._set(threads)
        self.last = threads

    def step(self, key: Hashable, work: float = 1.0) -> _Step:
        """Run one forward pass of the kind `key` names (the engines: its rows, and whether it is a
        one-token step or a prefill) on the count this tuner picks, timing it per unit of `work` (a
        prefill's tokens), so that passes of one kind but different lengths compare: `with
        tuner.step(key): <the pass>`."""
        if len(self.candidates) == 1:
            self.use(self.candidates[0])
            return _Step(None, 0, work, self)
        trial = self._by_key.setdefault(key, _Trial(self.candidates, self.first_look))
        threads = trial.next()
        self.use(threads)
        return _Step(trial, threads, work, self)


class _Step:
    """One timed pass (`ThreadTuner.step`): a plain object rather than a generator's context manager,
    whose extra Python calls each token would pay from caches its step has just flushed."""

    __slots__ = ("trial", "threads", "work", "tuner", "start")

    def __init__(self, trial: _Trial | None, threads: int, work: float, tuner: ThreadTuner) -> None:
        self.trial, self.threads, self.work, self.tuner = trial, threads, work, tuner

    def __enter__(self) -> None:
        self.start = self.tuner._clock() if self.trial is not None else 0.0

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.trial is not None and kind is None:
            seconds = (self.tuner._clock() - self.start) / self.work
            self.trial.record(self.threads, seconds, self.tuner)


BLAS_ENV = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "OMP_NUM_THREADS")
TORCH_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what fixes torch's CPU threads


def blas_tuner(
    threads: int | None = None, kernels: tuple[Callable[[], int], Callable[[int], None]] | None = None
) -> ThreadTuner:
    """A tuner over NumPy's BLAS threads, or with `kernels` (get and set the compiled kernels' threads)
    over those, BLAS then kept on one thread: it runs only the prefills, and its idle threads spin for a
    while after each product, taking a core from the kernels' threads for the steps that follow.
    `threads` fixed, else the environment's, else chosen by
    timing among `thread_candidates(cores())`. threadpoolctl (imported only when needed) switches BLAS."""
    fixed = threads or env_threads(BLAS_ENV)
    if kernels is None and fixed is not None and threads is None:
        return ThreadTuner(lambda: fixed, lambda n: None, [fixed])  # the library read it at start-up
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController().select(user_api="blas").lib_controllers

    def get_threads() -> int:
        return blas[0].get_num_threads() if blas else 1

    def set_threads(n: int) -> None:
        for lib in blas:
            lib.set_num_threads(n)

    candidates = [fixed] if fixed else thread_candidates(cores())
    if kernels is None:
        return ThreadTuner(get_threads, set_threads, candidates)
    get_kernels, set_kernels = kernels

    def set_both(n: int) -> None:
        set_threads(1)
        set_kernels(n)

    set_both(candidates[0])
    return ThreadTuner(get_kernels, set_both, candidates)
