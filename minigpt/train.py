"""Training as a function over typed configs: AdamW, warmup + cosine or WSD, eval, atomic checkpoints, resume."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from minigpt.config import GPTConfig
from minigpt.data import (
    BatchSampler,
    DataConfig,
    Dataset,
    _collect_files,
    bits_per_byte,
    eval_batches,
    prepare_data,
)
from minigpt.device import autocast_context, resolve_device, resolve_dtype
from minigpt.distributed import DistContext
from minigpt.errors import MinigptError, UsageError
from minigpt.model import GPT
from minigpt.params import count_params
from minigpt.presets import preset as get_preset
from minigpt.progress import Reporter
from minigpt.rundir import DEFAULT_ROOT, RunDir
from minigpt.tokenizer import Tokenizer
from minigpt.weights import build_model, model_tensors

EVAL_CHUNK = 256  # windows per evaluation forward pass, at most
EVAL_LOGITS = 1 << 25  # logits elements per evaluation forward pass, at most (128 MB in float32)


# Defaults by device. CPU: searched on tinyshakespeare (char) under a 70 s budget on 2 cores
# (bench/bench_train.py); at that budget a 2-layer model's extra steps beat more depth, small batches
# beat large ones, and holding the peak lr for half the run then decaying linearly to 0 (wsd) beat
# cosine to lr/10 by 0.01 in loss. GPU: nanoGPT's shakespeare_char recipe without dropout.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": dict(preset="nano", batch_size=16, lr=8e-3, schedule="wsd"),
    "gpu": dict(preset="small", batch_size=64, lr=1e-3, schedule="cosine"),
}
SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting; saved in the run's config.json and reused on --resume."""

    # model shape: a preset, then any explicit overrides (vocab_size always comes from the tokenizer)
    preset: str | None = None  # None: the device's recipe (RECIPES)
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    dropout: float = 0.0
    bias: bool = True
    # optimisation
    batch_size: int | None = None
    grad_accum: int = 1
    lr: float | None = None
    min_lr: float | None = None  # None: lr/10 for cosine, 0 for wsd
    warmup: int = 100
    # after warmup, "cosine" decays from lr to min_lr over the whole budget; "wsd" (warmup-stable-decay)
    # holds lr, then decays linearly to min_lr over the last `cooldown` fraction of the budget
    schedule: str | None = None
    cooldown: float = 0.5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    # budget: the first one reached stops the run
    max_iters: int | None = None
    max_time: float | None = None  # seconds
    max_tokens: int | None = None
    # evaluation and logging
    # 50 batches: on tinyshakespeare (char, batch 16) 20 x 16 evenly spaced windows read 0.015 above
    # the whole validation split's loss, 50 x 16 within 0.001; at 256 windows a pass, it costs about
    # what 20 x 16 did
    eval_every: int = 500
    eval_iters: int = 50
    log_every: int = 10
    # runtime
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        positive_ints = ("batch_size", "grad_accum", "eval_every", "eval_iters", "log_every")
        for name in positive_ints:
            value = getattr(self, name)
            if value is None and name == "batch_size":
                continue
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        for name in ("max_iters", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_time is not None and self.max_time <= 0:
            raise UsageError(f"--max-time must be positive, got {self.max_time}s")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else math.inf):
            raise UsageError(f"need 0 <= --min-lr <= --lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.preset is not None:
            get_preset(self.preset)
        if self.warmup < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise UsageError(
                "--warmup, --weight-decay and --grad-clip must not be negative (0 turns them off)"
            )
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise UsageError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise UsageError(f"unknown --schedule {self.schedule!r}: choose {' or '.join(SCHEDULES)}")
        if not 0 < self.cooldown <= 1:
            raise UsageError(f"--cooldown is a fraction of the budget in (0, 1], got {self.cooldown}")

    @property
    def has_budget(self) -> bool:
        return any(v is not None for v in (self.max_iters, self.max_time, self.max_tokens))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        data = {"schedule": "cosine", **data}  # runs saved before --schedule existed decayed by cosine
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_recipe(self, device_type: str) -> TrainConfig:
        """Fill the settings left unset with the recipe measured best for this kind of device."""
        recipe = RECIPES["cpu" if device_type == "cpu" else "gpu"]
        filled = {k: v for k, v in recipe.items() if getattr(self, k) is None}
        lr = self.lr if self.lr is not None else recipe["lr"]
        schedule = self.schedule or recipe["schedule"]
        if self.min_lr is None:
            filled["min_lr"] = lr / 10 if schedule == "cosine" else 0.0
        return replace(self, **filled)

    def model_config(self, vocab_size: int) -> GPTConfig:
        if self.preset is None:
            raise AssertionError("model_config needs a resolved config (with_recipe)")
        shape = get_preset(self.preset)
        shape.pop("vocab_size", None)
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) is not None:
                shape[name] = getattr(self, name)
        return GPTConfig(vocab_size=vocab_size, dropout=self.dropout, bias=self.bias, **shape)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s|ms)?", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '10m', '1h30m' or '1.5h'."""
    s = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if not m or m.end() == pos:
            break
        total += float(m.group(1)) * scale[m.group(2)]
        pos = m.end()
    if not s or pos != len(s) or total <= 0:
        raise UsageError(f"cannot read duration {text!r}: use e.g. 90s, 10m, 1h30m")
    return total


@dataclass
class TrainState:
    """Progress that a checkpoint must carry for an exact resume."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    best_val_loss: float = math.inf
    best_step: int = -1
    last_eval: dict[str, float] = field(default_factory=dict)
    # processes that trained the run so far: a resume on another count keeps the global batch
    world_size: int = 1


@dataclass
class TrainResult:
    out: Path
    state: TrainState
    interrupted: bool
    stop_reason: str
    metrics: list[dict[str, Any]]


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup` steps, then the schedule from lr to min_lr over the budget's progress:
    cosine, or wsd (constant, then linear over the last `cooldown` of the budget)."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "wsd":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * min(1.0, (1.0 - p) / cfg.cooldown)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * p))


def budget_progress(cfg: TrainConfig, state: TrainState, reserve: float = 0.0) -> float:
    """Fraction of the budget used: the largest of steps, time and tokens (1.0 means stop). `reserve`
    seconds of the time budget are kept for the final evaluation and save."""
    parts = [0.0]
    if cfg.max_iters is not None:
        parts.append(state.step / cfg.max_iters)
    if cfg.max_time is not None:
        parts.append(state.elapsed / max(cfg.max_time - reserve, 1e-9))
    if cfg.max_tokens is not None:
        parts.append(state.tokens / cfg.max_tokens)
    return max(parts)


def stop_reason(cfg: TrainConfig, state: TrainState, reserve: float = 0.0) -> str | None:
    if cfg.max_iters is not None and state.step >= cfg.max_iters:
        return f"reached --max-iters {cfg.max_iters}"
    if cfg.max_time is not None and state.elapsed + reserve >= cfg.max_time:
        return f"reached --max-time {cfg.max_time:g}s"
    if cfg.max_tokens is not None and state.tokens >= cfg.max_tokens:
        return f"reached --max-tokens {cfg.max_tokens:,}"
    return None


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on weight matrices (and the tied token embedding), not on wpe, biases or norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "wpe" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module,
    tokens: Any,
    cfg: TrainConfig,
    shape: GPTConfig,
    device: torch.device,
    dtype: torch.dtype,
    dist: DistContext,
) -> float:
    """Mean loss per window over eval_iters batches of evenly spaced windows: the same windows at every
    evaluation, shared out between ranks (one may get fewer, or none: windows are counted, not batches)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss x windows, windows
    # forward-only passes run faster on more windows at once (2x at 16 -> 256 windows of 64 on a CPU);
    # the logits of one pass stay under EVAL_LOGITS elements
    chunk = max(cfg.batch_size, min(EVAL_CHUNK, EVAL_LOGITS // (shape.block_size * shape.vocab_size)))
    batches = eval_batches(
        tokens, shape.block_size, cfg.batch_size, cfg.eval_iters, dist.rank, dist.world_size, chunk=chunk
    )
    for x, y in batches:
        with autocast_context(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        sums[0] += loss.double() * x.size(0)
        sums[1] += x.size(0)
    model.train(was_training)
    total, windows = dist.all_reduce_sum(sums).tolist()
    return total / max(windows, 1.0)


def _state_tensors(
    model: GPT, optimizer: torch.optim.Optimizer, sampler: BatchSampler
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_tensors(model).items()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value
    for key, value in sampler.state_dict().items():
        tensors[f"sampler/{key}"] = value
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    return tensors


def save_state(
    run: RunDir,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
    state: TrainState,
    cfg: TrainConfig,
) -> None:
    """The resumable state (latest weights, AdamW moments, sampler and RNG) as one atomic safetensors file."""
    meta = {"state": json.dumps(asdict(state)), "train": json.dumps(cfg.to_dict())}
    run.save_state(_state_tensors(model, optimizer, sampler), meta)


def load_state(
    run: RunDir, model: GPT, optimizer: torch.optim.Optimizer, sampler: BatchSampler
) -> TrainState:
    """Restore everything save_state wrote; any mismatch is a clean error."""
    tensors, meta = run.load_state()
    path = run.state_path
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    restored = build_model(model.config, weights, path, "cpu")
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), restored.named_parameters(), strict=True):
            p.copy_(q)
    for name, p in model.named_parameters():
        prefix = f"optim/{name}/"
        st = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        if st:
            optimizer.state[p] = {k: (v.to(p.device) if k != "step" else v) for k, v in st.items()}
    sampler.load_state_dict(
        {k.removeprefix("sampler/"): v for k, v in tensors.items() if k.startswith("sampler/")}
    )
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    try:
        return TrainState(**json.loads(meta["state"]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise MinigptError(f"{path} has an unreadable training state ({e})") from None


class _StopSignals:
    """First Ctrl-C/SIGTERM asks the loop to stop after the current step; a second one exits at once.

    Under torchrun a Ctrl-C reaches each worker twice, from the terminal and relayed by the launcher a moment
    later, so there a repeat within `grace` seconds counts as the same request.
    """

    def __init__(self, grace: float = 0.0) -> None:
        self.requested: str | None = None
        self.grace = grace
        self._first = 0.0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            if time.monotonic() - self._first < self.grace:
                return
            # saves are atomic, so leaving mid-write cannot corrupt the previous checkpoint
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        self._first = time.monotonic()

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopSignals]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)


def _resolve_run(
    cfg: TrainConfig,
    data: DataConfig | None,
    out: Path | None,
    resume: Path | None,
    init_from: Path | None,
    overwrite: bool,
    budget_overrides: dict[str, Any],
) -> tuple[TrainConfig, DataConfig, Path, Tokenizer | None, GPTConfig | None]:
    """Work out the settings of a new, resumed or fine-tuned run before touching the disk."""
    if resume is not None:
        source = RunDir(resume)
        saved = source.read_config()
        if not source.has_state():
            raise MinigptError(f"{resume} has no {RunDir.STATE}: nothing to resume")
        cfg = replace(TrainConfig.from_dict(saved["train"]), **budget_overrides)
        saved_data = saved["data"]
        data = DataConfig(
            **{
                **saved_data,
                "paths": tuple(Path(p) for p in saved_data["paths"]),
                "val_file": Path(saved_data["val_file"]) if saved_data.get("val_file") else None,
            }
        )
        return cfg, data, resume, source.tokenizer(), source.model_config(saved)
    if data is None:
        raise UsageError("give a text file to train on, or --resume DIR")
    out = out if out is not None else DEFAULT_ROOT / _default_name(data)
    RunDir(out).guard_new(overwrite)
    if init_from is not None:
        source = RunDir(init_from)
        # the shape is the source run's; dropout is a training choice, so --dropout applies
        shape = replace(source.model_config(), dropout=cfg.dropout)
        return cfg, data, out, source.tokenizer(), shape
    return cfg, data, out, None, None


def check_launch(
    nproc: int,
    cfg: TrainConfig,
    data: DataConfig | None = None,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    init_from: Path | None = None,
    overwrite: bool = False,
    budget_overrides: dict[str, Any] | None = None,
) -> None:
    """What `train --nproc N` can check before starting N processes: settings, run directory, input files,
    and one GPU per process."""
    cfg, data, *_ = _resolve_run(cfg, data, out, resume, init_from, overwrite, budget_overrides or {})
    _collect_files([*data.paths, *([data.val_file] if data.val_file else [])])
    if cfg.device == "mps":
        raise UsageError("several processes need CUDA GPUs or the CPU; --device mps trains in one process")
    gpus = torch.cuda.device_count() if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else 0
    if 0 < gpus < nproc:
        raise UsageError(f"--nproc {nproc} but only {gpus} CUDA GPU(s) here; use --nproc {gpus} or less")


def _default_name(data: DataConfig) -> str:
    stem = data.paths[0].stem if data.paths else "run"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "run"


def train(
    cfg: TrainConfig,
    data: DataConfig | None = None,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    init_from: Path | None = None,
    overwrite: bool = False,
    budget_overrides: dict[str, Any] | None = None,
    reporter: Reporter | None = None,
    on_step: Callable[[int], None] | None = None,
    started: float | None = None,
) -> TrainResult:
    """Train a model (new, resumed from `resume`, or starting from `init_from`'s weights) and save it.

    --max-time counts from `started` (a time.perf_counter() value; default: this call), so the CLI makes
    it the wall time of the whole command: start-up, data preparation, training and the final evaluation.
    """
    t_start = time.perf_counter() if started is None else started
    cfg, data, out, tokenizer, fixed_shape = _resolve_run(
        cfg, data, out, resume, init_from, overwrite, budget_overrides or {}
    )
    if resume is None and not cfg.has_budget:
        raise UsageError("give a budget: --max-iters, --max-time or --max-tokens")
    # every rank checks its settings before joining; rank 0 writes nothing until all have joined
    dist = DistContext.from_env(cfg.device)
    reporter = reporter or Reporter(enabled=dist.is_master)

    device = resolve_device(cfg.device, local_rank=dist.local_rank)
    cfg = cfg.with_recipe(device.type)
    torch.manual_seed(cfg.seed)

    planned = fixed_shape or cfg.model_config(1)
    dtype = resolve_dtype(cfg.dtype, device, training_width=planned.n_embd)
    block_size = planned.block_size
    with dist.master_first():
        dataset = prepare_data(data, block_size, tokenizer=tokenizer, progress=dist.is_master)
    tokenizer = dataset.tokenizer
    if fixed_shape is not None:
        model_config = fixed_shape
        if tokenizer.vocab_size > model_config.vocab_size:
            raise MinigptError("tokenizer is larger than the model's vocabulary")
    else:
        model_config = cfg.model_config(tokenizer.vocab_size)

    model = GPT(model_config).to(device)
    if init_from is not None and resume is None:
        source_run = RunDir(init_from)
        weights = source_run.load_weights(model_config)
        source = build_model(model_config, weights, source_run.weights_path, str(device))
        model.load_state_dict(source.state_dict())
    model.train()
    optimizer = make_optimizer(model, cfg, device)
    sampler = BatchSampler(
        dataset.train, model_config.block_size, cfg.batch_size, cfg.seed, dist.rank, dist.world_size
    )

    state = TrainState()
    run = RunDir(out)
    if resume is not None:
        state = load_state(run, model, optimizer, sampler)
        cfg = _keep_global_batch(cfg, state.world_size, dist.world_size, reporter)
        reporter.log(f"resuming {out} at step {state.step:,} ({state.tokens:,} tokens)")
    state.world_size = dist.world_size
    history = run.read_metrics() if resume is not None else []

    extra = {"train": cfg.to_dict(), "data": _data_dict(data), "metrics": {}}
    if dist.is_master:
        if resume is None:
            if out.exists() and overwrite:
                run.clear()
            run.save(model, tokenizer, extra, save_weights=False)
    train_model = dist.wrap(model, device)
    if cfg.compile:
        train_model = torch.compile(train_model)

    report = count_params(model_config)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * model_config.block_size * dist.world_size
    reporter.start(
        cfg,
        model_config,
        report.exact_total,
        tokenizer.describe(),
        dataset,
        device,
        dtype,
        out,
        dist.world_size,
    )

    recent_losses: list[float] = []

    # seconds the last evaluation and save took: the time budget keeps that much for the final one
    reserve = 0.0

    def evaluate_and_save(final: bool = False) -> None:
        nonlocal reserve
        t_eval = time.perf_counter()
        val_loss = estimate_loss(train_model, dataset.val, cfg, model_config, device, dtype, dist)
        # the mean training loss since the last evaluation: free, unlike a second pass over the train split
        train_loss = sum(recent_losses) / len(recent_losses) if recent_losses else math.nan
        recent_losses.clear()
        bpb = bits_per_byte(val_loss, len(dataset.val), dataset.val_bytes)
        state.last_eval = {
            "val_loss": val_loss,
            "train_loss": train_loss,
            "val_bpb": bpb,
            "val_ppl": math.exp(min(val_loss, 700)),
        }
        improved = val_loss < state.best_val_loss
        if improved:
            state.best_val_loss, state.best_step = val_loss, state.step
        record = {
            "step": state.step,
            "tokens": state.tokens,
            "elapsed": round(state.elapsed, 3),
            **state.last_eval,
        }
        history.append({"kind": "eval", **record})
        if dist.is_master:
            run.append_metrics({"kind": "eval", **record})
            extra["metrics"] = {
                "best_val_loss": state.best_val_loss,
                "best_step": state.best_step,
                "best_val_bpb": bits_per_byte(state.best_val_loss, len(dataset.val), dataset.val_bytes),
                "last": record,
            }
            run.save(model, tokenizer, extra, save_weights=improved)
            save_state(run, model, optimizer, sampler, state, cfg)
        reporter.evaluated(record, improved)
        dist.barrier()
        reserve = time.perf_counter() - t_eval

    signals = _StopSignals(grace=1.0 if dist.enabled else 0.0)
    interrupted = False
    reason = stop_reason(cfg, state)
    # the budget counts from `started` (start-up, data and model setup included); a resume carries the
    # elapsed time over
    t_resume = t_start - state.elapsed
    with signals.installed(), dist.peer_errors(out):
        while reason is None:
            if dist.enabled and model_config.dropout > 0:
                # each rank its own dropout masks, reproducible from the step alone (so on any process count)
                torch.manual_seed(_step_seed(cfg.seed, dist.rank, state.step))
            progress = budget_progress(cfg, state, reserve)
            lr = lr_at(cfg, state.step, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = sampler.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with (
                    dist.no_sync(train_model, last=micro == cfg.grad_accum - 1),
                    autocast_context(device, dtype),
                ):
                    _, loss = train_model(x, y)
                    loss = loss / cfg.grad_accum
                loss.backward()
                loss_sum += loss.detach()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            step_loss = dist.all_reduce_mean(loss_sum).item()  # all ranks see a NaN on any and stop together
            if not math.isfinite(step_loss):
                raise MinigptError(
                    f"loss became {step_loss} at step {state.step}: lower --lr (now {cfg.lr:g}) or "
                    f"raise --warmup; the last good checkpoint in {out} is untouched"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recent_losses.append(step_loss)
            state.step += 1
            state.tokens += tokens_per_step
            if on_step is not None:
                on_step(state.step)
            # one collective: whether any rank was asked to stop, and rank 0's clock for the time budget
            elapsed = time.perf_counter() - t_resume
            stop_asked, state.elapsed, reserve = dist.agree_stop(
                signals.requested is not None, elapsed, reserve
            )
            if state.step % cfg.log_every == 0 or state.step == 1:
                record = {
                    "step": state.step,
                    "tokens": state.tokens,
                    "elapsed": round(state.elapsed, 3),
                    "loss": step_loss,
                    "lr": lr,
                }
                history.append({"kind": "train", **record})
                if dist.is_master:
                    run.append_metrics({"kind": "train", **record})
                reporter.step(record, budget_progress(cfg, state, reserve), tokens_per_step)
            reason = stop_reason(cfg, state, reserve)
            if stop_asked:
                interrupted, reason = True, f"stopped by {signals.requested or 'a signal on another rank'}"
            if reason is None and state.step % cfg.eval_every == 0:
                evaluate_and_save()
        evaluate_and_save(final=True)
    total = time.perf_counter() - t_start
    reporter.finish(history, state, out, reason or "", interrupted, total, dataset)
    dist.close()
    return TrainResult(
        out=out, state=state, interrupted=interrupted, stop_reason=reason or "", metrics=history
    )


def _keep_global_batch(cfg: TrainConfig, saved_world: int, world: int, reporter: Reporter) -> TrainConfig:
    """On a resume with another number of processes, scale --grad-accum so a step sees as many sequences."""
    if saved_world == world:
        return cfg
    per_step = saved_world * cfg.grad_accum * cfg.batch_size
    if (saved_world * cfg.grad_accum) % world == 0:
        accum = saved_world * cfg.grad_accum // world
        reporter.log(
            f"the run was trained by {saved_world} process(es), now {world}: gradient accumulation "
            f"{cfg.grad_accum} -> {accum} keeps {per_step:,} sequences per step"
        )
        return replace(cfg, grad_accum=accum)
    reporter.log(
        f"warning: the run was trained by {saved_world} process(es) with {per_step:,} sequences per step; "
        f"{world} cannot keep that, so a step now sees {world * cfg.grad_accum * cfg.batch_size:,}"
    )
    return cfg


def _step_seed(seed: int, rank: int, step: int) -> int:
    text = f"minigpt-dropout:{seed}:{rank}:{step}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _data_dict(data: DataConfig) -> dict[str, Any]:
    d = asdict(data)
    d["paths"] = [str(p) for p in data.paths]
    d["val_file"] = str(data.val_file) if data.val_file else None
    d["cache_dir"] = str(data.cache_dir) if data.cache_dir else None
    return d


def dataset_summary(dataset: Dataset) -> str:
    return (
        f"{len(dataset.train):,} train / {len(dataset.val):,} val tokens "
        f"({dataset.val_bytes_per_token:.2f} bytes/token)"
    )
