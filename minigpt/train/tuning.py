"""Training's machine-dependent choices on the CPU, measured on this machine rather than carried over from
another: the autocast dtype, the dtype of Muon's iterations and of attention over few keys, and the thread
count.

Precision (`choose_precision`): whether bf16 autocast, or Muon's iterations in bf16, train faster than
float32 depends on the CPU (its bf16 instructions, its caches), the BLAS library and the model's shapes,
not on the moment. So the first run of a shape on a machine times a few real training steps (forward,
backward, clipping and the optimizers, the trainer's own `train_step`) of a throwaway copy of its model in
each candidate setting, round robin, and keeps each one's median in the decode tuning's cache
(`minigpt.generate.engines.tuning.remembered`, keyed by this CPU, its torch version and the run's shapes);
later runs read the answer. The copy steps on random tokens under a forked RNG, so measuring leaves the
run's own weights, batches and dropout exactly as they would be. It runs on every core, and only on a
machine that is not busy (a load under half its cores): on a busy one it would time the other work, so
the run keeps float32 and a later start measures. It stops at a time bound (`MEASURE_SECONDS`, less for a
short time budget); one that cannot time every candidate keeps float32 likewise, so a wrong guess never
costs more than the measurement.

Attention (`choose_attention`): where bf16 autocast is a candidate and the model's attention sees few keys,
attention may run in float32 through torch's fused kernel or as bf16 products
(minigpt.model.fused_attention), the faster depending on the CPU. It is timed first, on its own (one
layer's attention, forward and backward, on the run's shapes: milliseconds, so it adds no candidates to
the steps' measurement), cached alike, and the steps are then timed with the faster.

Threads (`step_threads`): the best count depends on the cores free at the moment, so it is not cached: a
`ThreadTuner` times the run's own steps on each count (1, 2, 4, ... the cores, and the cores but one), keeps
the fastest, tries the others again after 25 steps, then 50, 100, ... up to every `RECHECK_EVERY`, and at
once when the kept count's steps turn `SLOWDOWN` times slower (other work took a core: its OpenMP threads
would wait on each other at every barrier). A different count switches only when it is `MARGIN` times
faster. Thread counts change no result here (the same steps on 1 and 2 threads give the same bits on the
CPUs measured), but a library may split a sum differently on another count, so exact resumes are
promised for a fixed count (`--threads`, or OMP_NUM_THREADS).
"""

from __future__ import annotations

import copy
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from minigpt.common.device import cpu_has_bf16
from minigpt.data.dataset import BatchSampler
from minigpt.generate.engines.tuning import (
    TORCH_ENV,
    ThreadTuner,
    cache_file,
    cores,
    env_threads,
    measuring_blocked,
    remembered_times,
    thread_candidates,
)
from minigpt.model.config import GPTConfig
from minigpt.model.fused_attention import cpu_half_attention, fused_attention, products_apply
from minigpt.model.gpt import GPT
from minigpt.train.config import TrainConfig
from minigpt.train.optimizers import make_optimizer
from minigpt.train.step import Runtime, train_step

# the precision measurement's bound: room for a warm-up and a timed step of float32 and of bf16 where a step
# takes over a second (the wider models, where bf16 buys most); small models stop after ROUNDS rounds
MEASURE_SECONDS = 10.0
MEASURE_SHARE = 0.1  # of a time budget, when that is less
ROUNDS = 3  # timed steps of each candidate, at most
PRUNE = 1.5  # a candidate this many times slower than the fastest after one timed step is dropped
RECHECK_EVERY = 200  # steps between looks at the other thread counts, at most
SLOWDOWN = 1.4  # the kept count's steps this many times slower than when chosen: look again at once
MARGIN = 1.08  # another count replaces the kept one only when this many times faster
STEP_KEY = "train"  # the tuner's key for training steps
ATTENTION_SECONDS = 2.0  # the attention measurement's bound (MEASURE_SHARE of a shorter time budget)
ATTENTION_ROUNDS = 7  # timed calls of each attention dtype, at most
ATTENTION_CANDIDATES = ("float32", "bfloat16")  # torch's kernel on float32 copies, or bf16 products


class Unmeasured(Exception):
    """No measurement could be made: measuring is blocked (a busy machine, MINIGPT_MEASURE=off), or the
    time bound ran out before every candidate had a timed step."""


@dataclass(frozen=True)
class Precision:
    """The CPU run's autocast dtype, Muon's (None without Muon) and attention's over few keys (None where
    bf16 autocast runs none: see choose_attention), and how they were chosen."""

    dtype: str
    muon_dtype: str | None
    how: str  # measured, cached, given, or why float32 was kept
    seconds: Mapping[str, float]  # each candidate's step, by setting name (empty when nothing was timed)
    attention_dtype: str | None = None
    attention_seconds: Mapping[str, float] = field(default_factory=dict)  # one layer's, by dtype

    @property
    def name(self) -> str:
        return setting_name(self.dtype, self.muon_dtype)

    def describe(self) -> str:
        """The choice in words, with its step against float32's where both were timed."""
        words = f"{self.dtype} autocast" if self.dtype != "float32" else "float32"
        if self.muon_dtype is not None:
            words += f", Muon in {self.muon_dtype}"
        if self.attention_dtype is not None:
            words += f", {self._attention_words()}"
        plain = setting_name("float32", None if self.muon_dtype is None else "float32")
        if self.name != plain and {plain, self.name} <= set(self.seconds):
            words += f", {self.seconds[plain] / self.seconds[self.name]:.2f}x float32's steps"
        return f"{words} ({self.how})"

    def _attention_words(self) -> str:
        """Attention's dtype in words, with bf16 products' speed against float32's where both were timed."""
        products = self.attention_dtype == "bfloat16"
        words = "attention as bf16 products" if products else "attention in float32"
        timed = self.attention_seconds
        if {"float32", "bfloat16"} <= set(timed):
            speed = f"{timed['float32'] / timed['bfloat16']:.2f}x float32's"
            words += f" ({speed})" if products else f" (bf16 products {speed})"
        return words

    def record(self) -> dict[str, Any]:
        """What config.json keeps of the choice."""
        seconds = {name: round(s, 5) for name, s in self.seconds.items()}
        attention = {name: round(s, 6) for name, s in self.attention_seconds.items()}
        return {
            "dtype": self.dtype, "muon_dtype": self.muon_dtype, "attention_dtype": self.attention_dtype,
            "how": self.how, "step_seconds": seconds, "attention_seconds": attention,
        }  # fmt: skip


def setting_name(dtype: str, muon_dtype: str | None) -> str:
    """A candidate setting as the cache names it: 'bfloat16', or with Muon 'bfloat16, muon float32'."""
    return dtype if muon_dtype is None else f"{dtype}, muon {muon_dtype}"


def bf16_candidate() -> bool:
    """Whether bf16 is worth timing here: x86 without bf16 instructions emulates it, many times slower
    than float32 (so it is never tried there); on ARM torch cannot tell, so the measurement decides."""
    return cpu_has_bf16() or platform.machine().lower() in ("arm64", "aarch64")


def candidates(cfg: TrainConfig) -> list[tuple[str, str | None]]:
    """The (autocast dtype, Muon dtype) settings to time: each given setting fixed, each 'auto' float32 and,
    where bf16 is a candidate, bfloat16; Muon's None when the run has no Muon."""
    bf16 = ["float32", "bfloat16"] if bf16_candidate() else ["float32"]
    dtypes = bf16 if cfg.dtype == "auto" else [cfg.dtype]
    muons: list[str | None] = [None]
    if cfg.optimizer == "muon":
        muons = list(bf16) if cfg.muon_dtype == "auto" else [cfg.muon_dtype]
    return [(d, m) for d in dtypes for m in muons]


def measure_seconds(max_time: float | None) -> float:
    """The measurement's time bound: MEASURE_SECONDS, or MEASURE_SHARE of a shorter time budget."""
    return MEASURE_SECONDS if max_time is None else min(MEASURE_SECONDS, MEASURE_SHARE * max_time)


def cache_key(cfg: TrainConfig, model: torch.nn.Module) -> dict[str, Any]:
    """What a setting's speed depends on besides the machine: the library, the model and the step's shape.
    Not attention's dtype: it only ever speeds bf16 up, so a choice timed with either stands for both, and a
    run given the other one (--attention-dtype) reads the answer rather than measuring again."""
    shape = {k: v for k, v in asdict(model.config).items() if k != "dropout"}
    step = [cfg.batch_size, cfg.optimizer, cfg.orthogonalizer, cfg.normuon]
    return {"train precision": [shape, step], "torch": torch.__version__}


def choose_precision(
    cfg: TrainConfig,
    model: torch.nn.Module,
    runtime: Runtime,
    tuner: ThreadTuner,
    clock: Callable[[], float] = time.perf_counter,
) -> Precision:
    """The fastest of `candidates(cfg)` for this run on this CPU, with attention's dtype (`choose_attention`,
    decided first, so the steps are timed as they will run): one alone is simply taken; else the cache's
    answer, or a measurement (on a copy of `model`) that the cache keeps. A run that cannot be measured
    (several processes, whose ranks must agree; a busy machine; steps too long for the bound) keeps
    float32."""
    options = candidates(cfg)
    attention, attention_seconds = (None, {})
    if any(dtype == "bfloat16" for dtype, _ in options):
        attention, attention_seconds = choose_attention(cfg, model, runtime, tuner, clock)
    precision = _choose_dtypes(cfg, model, runtime, tuner, clock, options, attention)
    if precision.dtype != "bfloat16":
        return precision
    return replace(precision, attention_dtype=attention, attention_seconds=attention_seconds)


def _choose_dtypes(
    cfg: TrainConfig,
    model: torch.nn.Module,
    runtime: Runtime,
    tuner: ThreadTuner,
    clock: Callable[[], float],
    options: list[tuple[str, str | None]],
    attention: str | None,
) -> Precision:
    """choose_precision's choice among `options`, bf16 autocast's steps timed with attention in `attention`."""
    if len(options) == 1:
        dtype, muon = options[0]
        only = "as set" if cfg.dtype != "auto" else "the only candidate: no bf16 instructions"
        return Precision(dtype, muon, only, {})
    fallback = ("float32", None if options[0][1] is None else "float32")
    if runtime.dist.enabled:
        return Precision(*fallback, "several processes: not measured", {})
    names = {setting_name(*o): o for o in options}
    timed: dict[str, float] = {}
    runtime = replace(runtime, attention_dtype=getattr(torch, attention or "float32"))

    def measure() -> dict[str, float]:
        tuner.use(max(tuner.candidates))  # every core: measured only on a machine that is not busy
        timed.update(measure_steps(cfg, model, runtime, options, measure_seconds(cfg.max_time), clock))
        return timed

    try:
        best = remembered_times(cache_key(cfg, model), list(names), measure, measurements=1)
    except Unmeasured as e:
        return Precision(*fallback, f"not measured: {e}", {})
    chosen = min(names, key=lambda name: best[name])
    how = "measured on this machine" if timed else f"measured before on this machine: {cache_file()}"
    return Precision(*names[chosen], how, best)


def choose_attention(
    cfg: TrainConfig,
    model: torch.nn.Module,
    runtime: Runtime,
    tuner: ThreadTuner,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str | None, dict[str, float]]:
    """The dtype bf16 autocast runs `model`'s attention over few keys in, and each dtype's time where they
    were timed: None where none of it would run as products (`products_apply`), the one given, float32
    where nothing may be measured (several processes; a busy machine), else the faster of the two for one
    layer on the run's shapes, from the cache or measured now."""
    if not products_apply(model.config):
        return None, {}
    if cfg.attention_dtype != "auto":
        return cfg.attention_dtype, {}
    if runtime.dist.enabled:
        return "float32", {}
    assert cfg.batch_size is not None
    config = model.config
    shape = [cfg.batch_size, config.n_head, config.kv_heads, config.block_size, config.head_dim]
    key = {"train attention": shape, "torch": torch.__version__}

    def measure() -> dict[str, float]:
        tuner.use(max(tuner.candidates))
        bound = min(ATTENTION_SECONDS, measure_seconds(cfg.max_time))
        return measure_attention(cfg.batch_size, config, bound, clock)

    try:
        times = remembered_times(key, list(ATTENTION_CANDIDATES), measure, measurements=1)
    except Unmeasured:
        return "float32", {}
    return min(times, key=lambda name: times[name]), times


def measure_attention(
    batch: int, config: GPTConfig, seconds: float, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds of one layer's causal attention, forward and backward, on bf16 queries, keys and
    values of the run's shapes, in each of float32 and bf16 products (round robin within `seconds`).
    Raises Unmeasured as measure_steps does."""
    why = measuring_blocked()
    if why:
        raise Unmeasured(why)
    bf16, T, hd = torch.bfloat16, config.block_size, config.head_dim
    with torch.random.fork_rng(devices=[]):
        q = torch.randn(batch, config.n_head, T, hd, dtype=bf16, requires_grad=True)
        k, v = (torch.randn(batch, config.kv_heads, T, hd, dtype=bf16, requires_grad=True) for _ in range(2))
        grad = torch.randn_like(q)

    def attend(dtype: torch.dtype) -> Callable[[], None]:
        def run() -> None:
            with cpu_half_attention(dtype):
                fused_attention(q, k, v, None, True, 0.0, None).backward(grad)

        return run

    runs = {name: attend(getattr(torch, name)) for name in ATTENTION_CANDIDATES}
    times = interleaved(runs, clock() + seconds, clock, rounds=ATTENTION_ROUNDS)
    if len(times) < len(runs):
        raise Unmeasured("its attention was too slow to time within the measurement's bound")
    return {name: statistics.median(t) for name, t in times.items()}


def measure_steps(
    cfg: TrainConfig,
    model: torch.nn.Module,
    runtime: Runtime,
    options: list[tuple[str, str | None]],
    seconds: float,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Each setting's median seconds per training step of a copy of `model`, round robin within
    `seconds`. Raises Unmeasured when the machine is busy (a measurement would time other work) or the
    bound leaves a setting untimed."""
    why = measuring_blocked()
    if why:
        raise Unmeasured(why)
    with torch.random.fork_rng(devices=[]):
        times = interleaved(_copy_steps(cfg, model, runtime, options), clock() + seconds, clock)
    if len(times) < len(options):
        raise Unmeasured("its steps were too slow to time within the measurement's bound")
    return {setting_name(*o): statistics.median(times[o]) for o in options}


def _copy_steps(
    cfg: TrainConfig, model: torch.nn.Module, runtime: Runtime, options: list[tuple[str, str | None]]
) -> dict[tuple[str, str | None], Callable[[], object]]:
    """A training step of one throwaway copy of `model` per setting: the trainer's own step, each setting
    with its autocast and its own optimizer over the copy, on random tokens."""
    twin = copy.deepcopy(model)
    assert cfg.batch_size is not None and cfg.lr is not None and cfg.grad_clip is not None
    block = model.config.block_size
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 4 * block + 1)
    sampler = BatchSampler(tokens, block, cfg.batch_size, seed=0)
    optimizers = {m: make_optimizer(twin, replace(cfg, muon_dtype=m or "auto")) for _, m in options}
    steps: dict[tuple[str, str | None], Callable[[], object]] = {}
    for dtype, muon in options:
        on = replace(runtime, dtype=getattr(torch, dtype))
        # a small rate: the copy's steps must stay finite (a step whose loss is not finite skips the optimizer)
        steps[(dtype, muon)] = _step(twin, optimizers[muon], sampler, on, cfg.lr * 1e-3, cfg.grad_clip)
    return steps


def _step(
    model: torch.nn.Module, optimizer: Any, sampler: BatchSampler, runtime: Runtime, lr: float, clip: float
) -> Callable[[], object]:
    return lambda: train_step(model, optimizer, sampler, runtime, lr=lr, grad_clip=clip)


def interleaved(
    runs: Mapping[Any, Callable[[], object]],
    deadline: float,
    clock: Callable[[], float],
    rounds: int = ROUNDS,
    warm: bool = True,
) -> dict[Any, list[float]]:
    """Each run's timed calls: each called once untimed first (with `warm`: first calls pay one-off costs),
    then up to `rounds` timed calls each, round robin so that every run sees the same moments of load, a
    run more than PRUNE times slower than the fastest leaving after its first timed call. No call starts
    that its last one says would end past `deadline` (a `clock()` reading); runs left untimed are absent."""
    last: dict[Any, float] = {}
    for name, run in runs.items() if warm else ():
        if clock() + max(last.values(), default=0.0) > deadline:
            break
        start = clock()
        run()
        last[name] = clock() - start
    times: dict[Any, list[float]] = {name: [] for name in runs if name in last or not warm}
    live = list(times)
    if not live:  # the deadline came before any run was warm
        return {}
    for _ in range(rounds):
        for name in live:
            if clock() + last.get(name, 0.0) > deadline:
                return {n: t for n, t in times.items() if t}
            start = clock()
            runs[name]()
            last[name] = clock() - start
            times[name].append(last[name])
        best = min(min(t) for t in times.values() if t)
        live = [n for n in live if min(times[n]) <= PRUNE * best]
    return {n: t for n, t in times.items() if t}


def step_threads(threads: int | None = None, clock: Callable[[], float] = time.perf_counter) -> ThreadTuner:
    """A tuner over torch's CPU threads for training steps: `threads` fixed, else OMP_NUM_THREADS's (or
    MKL_NUM_THREADS's), else timed among 1, 2, 4, ... the cores and the cores but one (a core other work
    holds then costs its share), re-checked as the run goes."""
    fixed = threads or env_threads(TORCH_ENV)
    n = cores()
    counts = [fixed] if fixed else sorted({*thread_candidates(n), max(1, n - 1)})
    return ThreadTuner(
        torch.get_num_threads, torch.set_num_threads, counts, every=RECHECK_EVERY, margin=MARGIN,
        slowdown=SLOWDOWN, clock=clock,
    )  # fmt: skip


def describe_threads(tuner: ThreadTuner) -> str:
    """The thread count in words, for the run's log."""
    if len(tuner.candidates) == 1:
        return f"{tuner.candidates[0]} thread{'s' * (tuner.candidates[0] > 1)} (given)"
    counts = ", ".join(map(str, tuner.candidates))
    return f"threads timed on the run's steps among {counts}, and re-checked as it goes"


def probe_step(cfg: TrainConfig, vocab_size: int) -> Callable[[], object]:
    """A float32 training step of a fresh model of `cfg`'s shape (a resolved config): what the OpenMP
    probes (minigpt.train.spin) time."""
    model = GPT(cfg.model_config(vocab_size))
    setting = ("float32", "float32" if cfg.optimizer == "muon" else None)
    runtime = Runtime(torch.device("cpu"), torch.float32)
    return _copy_steps(cfg, model, runtime, [setting])[setting]
