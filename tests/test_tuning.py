"""Choices the engines make by measuring: the fastest layout, and the thread count of each step (fake clocks)."""

from __future__ import annotations

import json

import pytest

from minigpt.errors import UsageError
from minigpt.generate.engines import tuning
from minigpt.generate.engines.tuning import (
    ThreadTuner,
    best_times,
    blas_tuner,
    env_threads,
    pick_layout,
    thread_candidates,
)


class Clock:
    """A fake clock whose steps take as long as the test says for the current thread count."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """A stand-in thread pool: records every switch."""

    def __init__(self, threads: int = 2) -> None:
        self.threads = threads
        self.switches: list[int] = []

    def get(self) -> int:
        return self.threads

    def set(self, n: int) -> None:
        self.threads = n
        self.switches.append(n)


def run_steps(
    tuner: ThreadTuner, pool: Pool, clock: Clock, cost: dict[int, float], n: int, key: object = 1
) -> list[int]:
    """n steps, each taking cost[threads] seconds; the thread count each ran on."""
    used = []
    for _ in range(n):
        with tuner.step(key):
            used.append(pool.threads)
            clock.now += cost[pool.threads]
    return used


def test_trials_go_round_robin_then_the_fastest_count_stays() -> None:
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2, 4], trials=3, every=100, clock=clock)
    used = run_steps(tuner, pool, clock, {1: 1.2, 2: 1.0, 4: 1.1}, 20)
    assert used[:9] == [1, 2, 4] * 3  # every candidate sees the same moments
    assert used[9:] == [2] * 11 and tuner.chosen(1) == 2
    assert pool.switches == [1, 2, 4] * 3 + [2]  # the pool is switched only when the count changes


def test_a_count_far_slower_than_the_best_leaves_the_trial_after_one_step() -> None:
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2, 4], trials=3, clock=clock)
    used = run_steps(tuner, pool, clock, {1: 1.0, 2: 1.2, 4: 5.0}, 8)
    assert used == [1, 2, 4, 1, 2, 1, 2, 1]  # 4 threads: one step of 5 s, then out
    assert tuner.chosen(1) == 1
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2], trials=3, clock=clock)
    assert run_steps(tuner, pool, clock, {1: 1.0, 2: 9.0}, 4) == [1, 2, 1, 1] and tuner.chosen(1) == 1


def test_the_median_decides_not_one_lucky_step() -> None:
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2], trials=3, clock=clock)
    costs = iter([1.0, 0.9, 1.0, 1.4, 1.0, 1.4])  # 2 threads: one fast step, two slow ones
    for _ in range(6):
        with tuner.step(1):
            clock.now += next(costs)
    assert tuner.chosen(1) == 1


def test_prefills_compare_per_token() -> None:
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2], trials=2, clock=clock)
    for tokens, threads, seconds in [(10, 1, 0.6), (100, 2, 5.0), (20, 1, 1.2), (50, 2, 2.5)]:
        with tuner.step("prefill", work=tokens):
            assert pool.threads == threads
            clock.now += seconds
    assert tuner.chosen("prefill") == 2  # 0.05 s a token against 0.06, though each of its passes took longer


def test_each_number_of_rows_has_its_own_choice_and_a_change_of_load_is_followed() -> None:
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2], trials=2, every=10, clock=clock)
    run_steps(tuner, pool, clock, {1: 1.0, 2: 2.0}, 4, key=1)
    run_steps(tuner, pool, clock, {1: 2.0, 2: 1.0}, 4, key=8)
    assert (tuner.chosen(1), tuner.chosen(8), tuner.chosen(3)) == (1, 2, None)
    # the machine gets quieter: after `every` steps the rows-1 trial runs again and picks 2 threads
    used = run_steps(tuner, pool, clock, {1: 1.0, 2: 0.8}, 20, key=1)
    assert used == [1] * 8 + [1, 2, 1, 2] + [2] * 8  # 2 of its 10 steps since the choice came before
    assert tuner.chosen(1) == 2


def test_a_fixed_count_is_never_tried_against_another() -> None:
    pool, clock = Pool(3), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [3], clock=clock)
    assert run_steps(tuner, pool, clock, {3: 1.0}, 5) == [3] * 5 and pool.switches == []
    assert tuner.chosen(7) == 3


def test_thread_candidates_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [thread_candidates(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    for name in tuning.BLAS_ENV:
        monkeypatch.delenv(name, raising=False)
    assert env_threads(tuning.BLAS_ENV) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")  # OpenMP's nested form: the outer level counts
    assert env_threads(tuning.BLAS_ENV) == 3
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "0")  # not a count: the next variable decides
    assert env_threads(tuning.BLAS_ENV) == 3
    assert blas_tuner().candidates == [3]
    assert blas_tuner(1).candidates == [1]  # an explicit count beats the environment
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(tuning, "cores", lambda: 4)
    assert blas_tuner().candidates == [1, 2, 4]


def test_best_times_runs_everything_round_robin_and_keeps_each_ones_best() -> None:
    clock = Clock()
    calls: list[str] = []
    costs = {"a": iter([0.1, 2.0, 2.0, 2.0]), "b": iter([9.0, 3.0, 1.5, 3.0])}

    def run(name: str):
        def go() -> None:
            calls.append(name)
            clock.now += next(costs[name])

        return go

    assert best_times({"a": run("a"), "b": run("b")}, rounds=3, clock=clock) == {"a": 2.0, "b": 1.5}
    assert calls == ["a", "b"] * 4  # the untimed first calls (a's 0.1, b's 9.0) do not count


def test_best_times_prepares_each_call_untimed() -> None:
    """`prepare(name)` runs before each call of that run, and its time (10 s each here) is in no best."""
    clock = Clock()
    calls: list[str] = []

    def prepare(name: str) -> None:
        calls.append(f"prepare {name}")
        clock.now += 10.0

    def run(name: str, seconds: float):
        return lambda: calls.append(name) or setattr(clock, "now", clock.now + seconds)

    got = best_times({"a": run("a", 1.0), "b": run("b", 2.0)}, rounds=2, clock=clock, prepare=prepare)
    assert got == {"a": 1.0, "b": 2.0}
    assert calls == ["prepare a", "a", "prepare b", "b"] * 3


def test_a_layout_is_measured_on_three_loads_per_machine_and_model_then_remembered(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    built: list[str] = []
    forms = {"a": lambda: built.append("a") or "A", "b": lambda: built.append("b") or "B"}
    timed: list[dict[str, str]] = []
    # measured under load first (a looks faster), then on quieter moments (b is)
    measurements = iter(
        [{"a": 3.0, "b": 4.0}, {"a": 2.5, "b": 1.0}, {"a": 2.0, "b": 1.2}, {"a": 0.1, "b": 9.0}]
    )

    def times_of(trees: dict[str, str]) -> dict[str, float]:
        timed.append(trees)
        return next(measurements)

    key = {"engine": "test", "model": [1, [[2, 3]]]}
    assert pick_layout("auto", forms, times_of, key) == ("a", "A")
    assert timed == [{"a": "A", "b": "B"}] and built == ["a", "b"]  # both built once, timed together
    assert pick_layout("auto", forms, times_of, key)[0] == "b"  # the bests over both measurements
    assert pick_layout("auto", forms, times_of, key)[0] == "b" and len(timed) == 3
    built.clear()
    assert pick_layout("auto", forms, times_of, key) == ("b", "B")
    assert len(timed) == 3 and built == ["b"]  # read back: only the chosen form is built
    assert pick_layout("a", forms, times_of, key) == ("a", "A")  # a layout named is taken as given
    assert pick_layout("auto", forms, times_of, {**key, "new": 1}, can_measure=False) == ("a", "A")
    assert len(timed) == 3
    with pytest.raises(UsageError, match="unknown layout 'c'"):
        pick_layout("c", forms, times_of, key)
    # another model shape is measured anew; a damaged cache is measured over and rewritten
    always_b = lambda trees: timed.append(trees) or {"a": 2.0, "b": 1.0}  # noqa: E731
    assert pick_layout("auto", forms, always_b, {**key, "model": [2, [[2, 3]]]})[0] == "b" and len(timed) == 4
    tuning.cache_file().write_text("{not json")
    assert pick_layout("auto", forms, always_b, key)[0] == "b" and len(timed) == 5
    stored = json.loads(tuning.cache_file().read_text())
    stored[next(iter(stored))] = {"best": {"a": "fast"}, "count": 9}  # not times: measured again
    tuning.cache_file().write_text(json.dumps(stored))
    assert pick_layout("auto", forms, always_b, key)[0] == "b" and len(timed) == 6
    # an unwritable cache directory costs a measurement each time, never an error
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")
    assert pick_layout("auto", forms, always_b, key)[0] == "b" and len(timed) == 7


def test_a_choice_is_looked_at_again_soon_then_ever_less_often() -> None:
    """After a first choice the trial runs again 4 steps later (`first_look`), then 8, then 16, never
    more than `every` apart: a choice made in a moment of load is not kept for a whole generation."""
    pool, clock = Pool(), Clock()
    tuner = ThreadTuner(pool.get, pool.set, [1, 2], trials=1, every=12, first_look=4, clock=clock)
    used = run_steps(tuner, pool, clock, {1: 1.0, 2: 2.0}, 2 + 4 + 2 + 8 + 2 + 12 + 2 + 12 + 2)
    trials = [i for i in range(1, len(used)) if used[i] == 2]
    assert trials == [1, 7, 17, 31, 45]  # each after 4, 8, 12 (16 capped at `every`), 12 steps on 1 thread
