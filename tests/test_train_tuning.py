"""Training's choices measured on the machine (minigpt.train.tuning, minigpt.train.spin): the decision logic
with faked timings (either outcome, the cache, the overrides), and threads re-checked under a fake clock."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import FakeClock

from minigpt.cli.main import app
from minigpt.common.files import load_tensors
from minigpt.data.dataset import DataConfig
from minigpt.generate.engines import tuning as cache
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.train import spin, tuning
from minigpt.train.config import TrainConfig
from minigpt.train.loop import train
from minigpt.train.reporters import LineReporter
from minigpt.train.step import Runtime
from minigpt.train.tuning import Precision, choose_precision, interleaved, step_threads

CPU = Runtime(torch.device("cpu"), torch.float32)
TEXT = "".join(f"{w} the quick brown fox jumps over the lazy dog.\n" for w in ["alpha", "beta", "gamma"] * 80)


@pytest.fixture
def measuring(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Measuring allowed (conftest turns it off), however loaded the machine, into a cache of this test's
    own, on a CPU where bf16 is a candidate."""
    monkeypatch.delenv(cache.MEASURE_ENV, raising=False)
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "measuring_blocked", lambda: None)
    monkeypatch.setattr(spin, "measuring_blocked", lambda: None)
    monkeypatch.setattr(tuning, "bf16_candidate", lambda: True)


@pytest.fixture
def probing(measuring: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linux machine of 2 free cores without a GPU, no spin or thread count in the environment."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(spin.sys, "platform", "linux")
    monkeypatch.setattr(spin, "_accelerator", lambda: False)
    monkeypatch.setattr(spin, "cores", lambda: 2)


def fake_steps(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[list[str]]:
    """measure_steps faked: every setting takes `seconds[its dtype]` (Muon's dtype adds a tenth of
    `seconds`' own for it); the settings of each measurement are recorded, with the attention dtype its
    steps ran in. measure_attention faked too: a hundredth of `seconds[its dtype]`, each call recorded."""
    calls: list[list[str]] = []

    def measure(cfg, model, runtime, options, bound, clock):  # noqa: ANN001, ANN202
        calls.append([tuning.setting_name(*o) for o in options] + [f"attention {runtime.attention_dtype}"])
        return {tuning.setting_name(d, m): seconds[d] + (0.1 * seconds[m] if m else 0.0) for d, m in options}

    def attention(batch, config, bound, clock):  # noqa: ANN001, ANN202
        calls.append(["attention"])
        return {dtype: seconds[dtype] / 100 for dtype in ("float32", "bfloat16")}

    monkeypatch.setattr(tuning, "measure_steps", measure)
    monkeypatch.setattr(tuning, "measure_attention", attention)
    return calls


def tiny(**kw) -> tuple[TrainConfig, GPT]:  # noqa: ANN003
    cfg = TrainConfig(**{"preset": "tiny", "batch_size": 4, "max_iters": 5, "device": "cpu", **kw})
    cfg = cfg.with_recipe("cpu")
    return cfg, GPT(cfg.model_config(32))


def one_thread() -> cache.ThreadTuner:
    return cache.ThreadTuner(lambda: 1, lambda n: None, [1])


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])
def test_the_faster_precision_is_chosen_and_kept_per_machine_and_shape(
    measuring: None, monkeypatch: pytest.MonkeyPatch, faster: str
) -> None:
    slower = "float32" if faster == "bfloat16" else "bfloat16"
    calls = fake_steps(monkeypatch, {faster: 1.0, slower: 1.5})
    cfg, model = tiny()  # the CPU recipe: Muon, so its dtype is chosen too
    first = choose_precision(cfg, model, CPU, one_thread())
    chosen = (faster, faster, "bfloat16" if faster == "bfloat16" else None)  # attention's: under bf16 only
    assert (first.dtype, first.muon_dtype, first.attention_dtype) == chosen
    assert first.how == "measured on this machine"
    # attention first, then every autocast dtype with every Muon dtype, bf16's with the faster attention
    assert calls[0] == ["attention"] and len(calls[1]) == 5
    assert calls[1][-1] == f"attention {getattr(torch, faster)}"
    again = choose_precision(cfg, model, CPU, one_thread())  # the cache's answers: no measuring
    assert (again.dtype, again.muon_dtype, again.attention_dtype) == chosen and len(calls) == 2
    assert again.how.startswith("measured before on this machine") and again.seconds == first.seconds
    assert again.attention_seconds == first.attention_seconds
    other, bigger = tiny(batch_size=8)
    choose_precision(other, bigger, CPU, one_thread())  # another shape of step: measured for itself
    assert len(calls) == 4
    entries = json.loads(cache.cache_file().read_text())
    entry = next(e for key, e in entries.items() if "train precision" in key)
    assert entry["count"] == 1 and set(entry["best"]) == set(calls[1][:-1])


def test_given_dtypes_are_not_measured_and_a_given_one_narrows_the_measurement(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_steps(monkeypatch, {"float32": 1.5, "bfloat16": 1.0})
    cfg, model = tiny(dtype="float32", muon_dtype="float32")
    assert choose_precision(cfg, model, CPU, one_thread()) == Precision("float32", "float32", "as set", {})
    assert calls == []
    cfg, model = tiny(dtype="float32")  # Muon's dtype alone is timed, autocast stays as given
    chosen = choose_precision(cfg, model, CPU, one_thread())
    assert calls == [["float32, muon float32", "float32, muon bfloat16", "attention torch.float32"]]
    assert (chosen.dtype, chosen.muon_dtype, chosen.attention_dtype) == ("float32", "bfloat16", None)
    cfg, model = tiny(optimizer="adamw")
    adamw = choose_precision(cfg, model, CPU, one_thread())
    assert (adamw.name, adamw.attention_dtype) == ("bfloat16", "bfloat16")
    assert calls[-2:] == [["attention"], ["float32", "bfloat16", "attention torch.bfloat16"]]
    # attention's dtype given: not measured, and the steps' answer read (the cache does not key on it)
    cfg, model = tiny(optimizer="adamw", attention_dtype="float32")
    given_attention = choose_precision(cfg, model, CPU, one_thread())
    assert (given_attention.name, given_attention.attention_dtype) == ("bfloat16", "float32")
    assert len(calls) == 3
    cfg, model = tiny(optimizer="adamw", dtype="bfloat16", attention_dtype="bfloat16")
    given = choose_precision(cfg, model, CPU, one_thread())
    assert given == Precision("bfloat16", None, "as set", {}, "bfloat16") and len(calls) == 3
    # no attention would run as products (dropout on the weights): nothing to choose or time
    cfg, model = tiny(optimizer="adamw", overrides=dict(dropout=0.1), batch_size=2)
    assert choose_precision(cfg, model, CPU, one_thread()).attention_dtype is None
    assert calls[-1] == ["float32", "bfloat16", "attention torch.float32"] and len(calls) == 4


def test_without_bf16_or_without_a_measurement_the_run_keeps_float32(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, model = tiny()
    monkeypatch.setattr(tuning, "bf16_candidate", lambda: False)
    plain = choose_precision(cfg, model, CPU, one_thread())
    assert (plain.dtype, plain.muon_dtype, plain.attention_dtype) == ("float32", "float32", None)
    assert "no bf16" in plain.how
    monkeypatch.setattr(tuning, "bf16_candidate", lambda: True)
    monkeypatch.setattr(tuning, "measuring_blocked", lambda: "the machine is busy")
    busy = choose_precision(cfg, model, CPU, one_thread())
    assert busy.name == "float32, muon float32" and busy.how == "not measured: the machine is busy"
    assert not cache.cache_file().exists()  # nothing kept: a quieter start measures
    cfg, model = tiny(dtype="bfloat16", muon_dtype="float32")  # bf16 given: attention not measured either
    assert choose_precision(cfg, model, CPU, one_thread()).attention_dtype == "float32"


def test_a_measurement_the_bound_cuts_short_keeps_float32_and_is_tried_again(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps too slow for the bound: no setting may be chosen on half a measurement."""
    cfg, model = tiny(optimizer="adamw")
    clock = FakeClock()

    def slow_interleaved(runs, deadline, clock_, rounds=3, warm=True):  # noqa: ANN001, ANN202
        return {}

    monkeypatch.setattr(tuning, "interleaved", slow_interleaved)
    kept = choose_precision(cfg, model, CPU, one_thread(), clock)
    assert kept.name == "float32" and "too slow" in kept.how and not cache.cache_file().exists()


def test_measuring_times_a_copy_and_leaves_the_run_as_it_was(measuring: None) -> None:
    """The real measurement, on a clock that moves one second a reading: every setting timed, and the
    model's weights and torch's random state untouched (the run trains as if nothing had been timed)."""
    cfg, model = tiny(overrides=dict(dropout=0.1))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    ticks = iter(range(10**6))
    options = tuning.candidates(cfg)
    times = tuning.measure_steps(cfg, model, CPU, options, 1e9, lambda: float(next(ticks)))
    assert set(times) == {tuning.setting_name(*o) for o in options} and all(t > 0 for t in times.values())
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_measuring_attention_times_both_dtypes_and_leaves_the_random_state(measuring: None) -> None:
    """The real measurement, on a clock that moves one second a reading: both dtypes timed (the products
    pruned after one timed call if 1.5 times slower), torch's random state untouched."""
    state = torch.get_rng_state()
    ticks = iter(range(10**6))
    times = tuning.measure_attention(
        2,
        GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32),
        1e9,
        lambda: float(next(ticks)),
    )
    assert set(times) == {"float32", "bfloat16"} and all(t > 0 for t in times.values())
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(tuning.Unmeasured, match="too slow"):
        tuning.measure_attention(
            2,
            GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32),
            0.5,
            lambda: float(next(ticks)),
        )


def test_a_wide_models_second_long_steps_are_timed_in_each_dtype_within_the_bound(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose float32 step takes 1.5 s and bf16's 1 s (plus one-off costs on each first call): the
    measurement's own bound, with no time budget and with a 75 s one, times both and picks bf16."""
    clock = FakeClock(0.0)
    cost = {"float32": 1.5, "bfloat16": 1.0}

    def copy_steps(cfg, model, runtime, options):  # noqa: ANN001, ANN202
        first = set(options)

        def step(option: tuple[str, None]) -> Callable[[], None]:
            def go() -> None:
                clock.now += cost[option[0]] + (0.5 if option in first else 0.0)
                first.discard(option)

            return go

        return {o: step(o) for o in options}

    monkeypatch.setattr(tuning, "_copy_steps", copy_steps)
    cfg, model = tiny(optimizer="adamw")
    for budget in (None, 75.0):
        bound = tuning.measure_seconds(budget)
        times = tuning.measure_steps(cfg, model, CPU, tuning.candidates(cfg), bound, clock)
        assert times == {"float32": 1.5, "bfloat16": 1.0}


def test_interleaved_warms_up_goes_round_robin_prunes_and_stops_at_the_deadline() -> None:
    clock = FakeClock(0.0)
    order: list[str] = []
    cost = {"a": 1.0, "b": 1.25, "c": 5.0}  # exact in binary, so the sums are

    def run(name: str) -> Callable[[], None]:
        def go() -> None:
            order.append(name)
            clock.now += cost[name]

        return go

    times = interleaved({n: run(n) for n in cost}, 1e9, clock)
    assert order == ["a", "b", "c"] * 2 + ["a", "b"] * 2  # warm-ups, then c leaves after one timed step
    assert times == {"a": [1.0] * 3, "b": [1.25] * 3, "c": [5.0]}
    order.clear()
    clock.now = 0.0
    # the warm-ups (7.25 s) fit, no timed step does
    assert interleaved({n: run(n) for n in cost}, 7.5, clock) == {}
    clock.now = 0.0
    assert interleaved({n: run(n) for n in "ab"}, 4.3, clock) == {"a": [1.0]}  # b's timed step would overrun


def test_threads_follow_the_cores_free_under_a_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quiet: 2 threads. Another process takes a core: the kept count slows down, so both are tried again
    at once and 1 thread is kept. Quiet again: the next look goes back to 2."""
    monkeypatch.setattr(tuning, "cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    clock = FakeClock(0.0)
    tuner = step_threads(clock=clock)
    pool = {"threads": 2}
    tuner._get, tuner._set = (lambda: pool["threads"]), (lambda n: pool.update(threads=n))
    quiet, busy = {1: 0.8, 2: 0.6}, {1: 1.1, 2: 4.0}
    used: list[int] = []

    def steps(n: int, cost: dict[int, float]) -> list[int]:
        for _ in range(n):
            with tuner.step(tuning.STEP_KEY):
                used.append(pool["threads"])
                clock.now += cost[pool["threads"]]
        return used[-n:]

    assert steps(10, quiet) == [1, 2, 1, 2, 1, 2] + [2] * 4 and tuner.chosen(tuning.STEP_KEY) == 2
    # three slow steps in a row, then a trial: 2 threads (4 s) leaves after one step against 1's 1.1 s
    assert steps(8, busy) == [2, 2, 2, 1, 2, 1, 1, 1] and tuner.chosen(tuning.STEP_KEY) == 1
    back = steps(60, quiet)
    assert back.index(2) == 48 and back[-1] == 2 and tuner.chosen(tuning.STEP_KEY) == 2
    # the look after a trial comes twice as late: 50 steps from the choice, 3 of them in the busy spell


def test_a_count_only_slightly_faster_does_not_replace_the_kept_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    clock = FakeClock(0.0)
    tuner = step_threads(clock=clock)
    pool = {"threads": 2}
    tuner._get, tuner._set = (lambda: pool["threads"]), (lambda n: pool.update(threads=n))
    for cost in ({1: 1.0, 2: 0.8}, {1: 0.95, 2: 1.0}):  # 1 thread then 5% faster: within the margin
        for _ in range(30):
            with tuner.step(tuning.STEP_KEY):
                clock.now += cost[pool["threads"]]
    assert tuner.chosen(tuning.STEP_KEY) == 2


def test_a_busy_machine_measures_nothing_unless_measuring_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "cores", lambda: 2)
    monkeypatch.setattr(cache.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.delenv(cache.MEASURE_ENV, raising=False)
    assert cache.measuring_blocked() is None
    monkeypatch.setenv(cache.MEASURE_ENV, "OFF")
    assert cache.measuring_blocked() == "MINIGPT_MEASURE=off"
    monkeypatch.setattr(cache.os, "getloadavg", lambda: (2.8, 2.8, 2.8))
    monkeypatch.delenv(cache.MEASURE_ENV)
    assert "busy (load 2.8 on 2 cores)" in (cache.measuring_blocked() or "")
    monkeypatch.setenv(cache.MEASURE_ENV, "on")  # the load is the user's own, or a smoke test's
    assert cache.measuring_blocked() is None


def test_thread_counts_come_from_the_option_the_environment_or_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(tuning, "cores", lambda: 6)
    assert step_threads().candidates == [1, 2, 4, 5, 6]  # the cores but one: one taken costs its share
    assert step_threads(3).candidates == [3]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert step_threads().candidates == [2] and step_threads(4).candidates == [4]
    assert "given" in tuning.describe_threads(step_threads())


def test_the_spin_is_measured_once_then_read_and_the_environment_stands(
    probing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes: list[TrainConfig] = []

    def pair(cfg: TrainConfig, clock: object) -> dict[str, float]:
        probes.append(cfg)
        return {"10000": 1.3, "300000": 1.0}

    monkeypatch.setattr(spin, "probe_pair", pair)
    spin.choose(TrainConfig())
    assert os.environ["GOMP_SPINCOUNT"] == "300000" == spin.chosen["value"]
    assert spin.chosen["how"].startswith("measured on this machine; steps 1.30x faster than with 10000")
    monkeypatch.delenv("GOMP_SPINCOUNT")  # a later command: it reads the cache, probing nothing
    spin.choose(TrainConfig())
    assert len(probes) == 1 and spin.chosen["how"].startswith("measured before on this machine")
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    spin.choose(TrainConfig())
    assert os.environ["GOMP_SPINCOUNT"] == "123" and spin.chosen["how"] == "the environment's"


@pytest.mark.parametrize(
    ("cfg", "processes", "why"),
    [
        (TrainConfig(threads=1), 1, "one thread never waits"),
        (TrainConfig(device="cuda"), 1, "accelerator"),
        (TrainConfig(), 2, "several processes"),
    ],
)
def test_the_spin_is_not_measured_where_it_cannot_matter(
    probing: None, monkeypatch: pytest.MonkeyPatch, cfg: TrainConfig, processes: int, why: str
) -> None:
    monkeypatch.setattr(spin, "probe_pair", lambda cfg, clock: pytest.fail("probed"))
    spin.choose(cfg, processes)
    assert os.environ["GOMP_SPINCOUNT"] == spin.FALLBACK and why in spin.chosen["how"]


def test_unfinished_probes_leave_the_fallback_and_measure_next_time(
    probing: None, monkeypatch: pytest.MonkeyPatch
) -> None:

    def late(cfg: TrainConfig, clock: object) -> dict[str, float]:
        raise spin.Unmeasured("the probes did not finish within the time bound")

    monkeypatch.setattr(spin, "probe_pair", late)
    spin.choose(TrainConfig())
    assert os.environ["GOMP_SPINCOUNT"] == spin.FALLBACK and "did not finish" in spin.chosen["how"]
    assert not cache.cache_file().exists()


@pytest.mark.slow
def test_two_real_probes_take_turns_and_time_their_steps(
    measuring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spin, "SECONDS", 600.0)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    times = spin.probe_pair(TrainConfig(preset="tiny", batch_size=2))
    assert set(times) == set(spin.SPINS) and all(t > 0 for t in times.values())


def test_a_probe_lets_its_spin_run_out_before_the_other_takes_its_turn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe reports its turn only after sleeping SETTLE: reported at once, its threads would still be
    spinning on the cores during the other probe's first steps, and the longer spin would time faster."""
    events: list[str] = []
    monkeypatch.setattr(tuning, "probe_step", lambda cfg, vocab: lambda: events.append("step"))
    monkeypatch.setattr(spin.time, "sleep", lambda s: events.append(f"sleep {s}"))
    monkeypatch.setattr(spin.sys, "stdin", io.StringIO("2\n1\n"))
    spin.probe(json.dumps({"train": TrainConfig(preset="tiny").to_dict(), "vocab_size": 8}))
    assert events == ["step", "step", f"sleep {spin.SETTLE}", "step", f"sleep {spin.SETTLE}"]
    assert len(capsys.readouterr().out.splitlines()) == 3  # ready, then one line a turn


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_a_run_measures_records_and_trains_as_if_given_the_choice(
    measuring: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dropout: float
) -> None:
    """bf16 measured faster (each setting's steps really taken on the copy, their times faked), and without
    dropout on the weights bf16 products faster for attention: the run trains in it, says so once, records
    it in config.json (its settings and the machine's record), and its weights and optimizer state are
    those of a run given the same dtypes by name (with dropout: the random state left as it was)."""
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    data = DataConfig(paths=(tmp_path / "t.txt",), tokenizer="char", cache_dir=tmp_path / "tok")
    taken: list[tuple[str, str | None]] = []

    def rigged(runs, deadline, clock, rounds=3, warm=True):  # noqa: ANN001, ANN202
        for setting, run in runs.items():
            run()
            taken.append(setting)
        if "bfloat16" in runs:  # attention's two dtypes: products twice as fast
            return {dtype: [0.01 if dtype == "bfloat16" else 0.02] for dtype in runs}
        return {(d, m): [(1.03 if d == "bfloat16" else 1.5) - 0.03 * (m == "bfloat16")] for d, m in runs}

    monkeypatch.setattr(tuning, "interleaved", rigged)
    base = dict(
        preset="tiny", batch_size=4, max_iters=4, eval_iters=1, device="cpu", overrides={"dropout": dropout}
    )
    log = io.StringIO()
    train(TrainConfig(**base), data, out=tmp_path / "auto", reporter=LineReporter(log))
    products = not dropout  # attention's dtypes are timed first, where products may run at all
    assert taken[:2] == (
        ["float32", "bfloat16"] if products else [("float32", "float32"), ("float32", "bfloat16")]
    )
    assert len(taken) == 4 + 2 * products
    attention = ", attention as bf16 products (2.00x float32's)" if products else ""
    assert (
        f"on this machine: bfloat16 autocast, Muon in bfloat16{attention}, 1.50x float32's steps"
        in log.getvalue()
    )
    saved = RunDir(tmp_path / "auto").read_config()
    chosen = [saved["train"][name] for name in ("dtype", "muon_dtype", "attention_dtype")]
    assert chosen == ["bfloat16", "bfloat16", "bfloat16" if products else "auto"]
    assert saved["machine"]["precision"]["how"] == "measured on this machine"
    timed = {"float32": 0.02, "bfloat16": 0.01} if products else {}
    assert saved["machine"]["precision"]["attention_seconds"] == timed
    given = dict(dtype="bfloat16", muon_dtype="bfloat16", attention_dtype=chosen[2])
    train(TrainConfig(**base, **given), data, out=tmp_path / "given")
    first, _ = load_tensors(tmp_path / "auto" / RunDir.STATE)
    second, _ = load_tensors(tmp_path / "given" / RunDir.STATE)
    assert all(torch.equal(first[k], second[k]) for k in first if k.startswith(("model/", "optim/")))


def test_the_command_line_takes_threads_and_logs_the_choices(runner, tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    args = ["train", str(tmp_path / "t.txt"), "--preset", "tiny", "--max-iters", "2", "--eval-iters", "1"]
    result = runner.invoke(app, [*args, "--tokenizer", "char", "--device", "cpu", "--threads", "1", "--out",
                                 str(tmp_path / "run")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "1 thread (given)" in result.output and "OpenMP spin" in result.output
    assert "not measured: MINIGPT_MEASURE=off" in result.output
    assert RunDir(tmp_path / "run").read_config()["train"]["threads"] == 1
    bad = runner.invoke(app, [*args, "--threads", "0"])
    assert bad.exit_code == 2 and "--threads" in bad.output
