"""Setting up a training run: its settings (new, resumed or fine-tuned), data, model, optimizer and state."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.budget import Budget
from minigpt.config import GPTConfig
from minigpt.data import BatchSampler, DataConfig, Dataset, _collect_files, prepare_data
from minigpt.device import resolve_device, resolve_dtype
from minigpt.distributed import DistContext
from minigpt.errors import MinigptError, UsageError
from minigpt.model import GPT
from minigpt.params import count_params
from minigpt.reporters import ProgressReporter, TrainingStart
from minigpt.rundir import DEFAULT_ROOT, RunDir
from minigpt.tokenizer import Tokenizer
from minigpt.trainconfig import BUDGET_SETTINGS, TrainConfig
from minigpt.trainstate import Trainables, TrainState, load_checkpoint
from minigpt.trainstep import Runtime
from minigpt.weights import build_model

SamplerFactory = Callable[[np.ndarray, int, int, int, int, int], BatchSampler]


@dataclass(frozen=True)
class RunPlan:
    """The settings of a new, resumed or fine-tuned run, worked out before anything touches the disk."""

    cfg: TrainConfig
    data: DataConfig
    out: Path
    resume: bool = False
    init_from: Path | None = None
    overwrite: bool = False
    tokenizer: Tokenizer | None = None  # a resumed or fine-tuned run's
    shape: GPTConfig | None = None  # likewise


def plan_run(
    cfg: TrainConfig,
    data: DataConfig | None = None,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    init_from: Path | None = None,
    overwrite: bool = False,
) -> RunPlan:
    """A new run on `data` (into `out`, refused if it holds a run unless `overwrite`), a resume of `resume`
    (with its saved settings; budget settings in `cfg` replace the saved ones), or a run starting from
    `init_from`'s weights and tokenizer."""
    if resume is not None:
        return _plan_resume(cfg, resume, data=data, out=out, init_from=init_from)
    if data is None:
        raise UsageError("give the text to train on (a DataConfig), or a run to resume")
    if not cfg.has_budget:
        raise UsageError("give a budget: max_iters, max_time or max_tokens")
    out = out if out is not None else DEFAULT_ROOT / _default_name(data)
    RunDir(out).guard_new(overwrite)
    if init_from is None:
        return RunPlan(cfg, data, out, overwrite=overwrite)
    source = RunDir(init_from)
    # the shape is the source run's; dropout is a training choice, so cfg's applies
    shape = replace(source.model_config(), dropout=cfg.dropout)
    return RunPlan(cfg, data, out, False, init_from, overwrite, source.tokenizer(), shape)


def _plan_resume(cfg: TrainConfig, resume: Path, **others: Any) -> RunPlan:
    defaults = TrainConfig()
    changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)]
    refused = [name for name in changed if name not in BUDGET_SETTINGS]
    refused += [name for name, value in others.items() if value is not None]
    if refused:
        raise UsageError(
            f"a resume keeps the run's saved settings; only the budget may change (got {', '.join(refused)})"
        )
    source = RunDir(resume)
    saved = source.read_config()
    if not source.has_state():
        raise MinigptError(f"{resume} has no {RunDir.STATE}: nothing to resume")
    saved_cfg = replace(TrainConfig.from_dict(saved["train"]), **cfg.budget())
    saved_data = saved["data"]
    data = DataConfig(
        **{
            **saved_data,
            "paths": tuple(Path(p) for p in saved_data["paths"]),
            "val_file": Path(saved_data["val_file"]) if saved_data.get("val_file") else None,
        }
    )
    shape = source.model_config(saved)
    return RunPlan(saved_cfg, data, resume, True, tokenizer=source.tokenizer(), shape=shape)


def check_launch(nproc: int, plan: RunPlan) -> None:
    """What `train --nproc N` can check before starting N processes: input files and one GPU per process
    (plan_run has checked the settings and the run directory)."""
    _collect_files([*plan.data.paths, *([plan.data.val_file] if plan.data.val_file else [])])
    device = plan.cfg.device
    if device == "mps":
        raise UsageError("several processes need CUDA GPUs or the CPU; device mps trains in one process")
    gpus = torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 0
    if 0 < gpus < nproc:
        raise UsageError(f"{nproc} processes but only {gpus} CUDA GPU(s) here; use {gpus} or fewer")


def _default_name(data: DataConfig) -> str:
    stem = data.paths[0].stem if data.paths else "run"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "run"


def data_dict(data: DataConfig) -> dict[str, Any]:
    """`data` as config.json's data section."""
    d = asdict(data)
    d["paths"] = [str(p) for p in data.paths]
    d["val_file"] = str(data.val_file) if data.val_file else None
    d["cache_dir"] = str(data.cache_dir) if data.cache_dir else None
    return d


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


def keep_global_batch(
    cfg: TrainConfig, saved_world: int, world: int, reporter: ProgressReporter
) -> TrainConfig:
    """On a resume with another number of processes, scale grad_accum so a step sees as many sequences."""
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


@dataclass
class TrainingRun:
    """Everything a training loop works with, set up and ready for the first (or next) step."""

    cfg: TrainConfig  # resolved: the device's recipe filled in
    rundir: RunDir
    runtime: Runtime
    dataset: Dataset
    parts: Trainables  # the bare model, optimizer and sampler: what a checkpoint saves
    forward: torch.nn.Module  # the model as steps and evaluations call it (under DDP, compiled)
    state: TrainState
    budget: Budget
    settings: dict[str, Any]  # config.json's train, data and metrics sections
    history: list[dict[str, Any]]  # every metrics record of the run, earlier commands' included
    recent_losses: list[float] = field(default_factory=list)  # step losses since the last evaluation

    @property
    def model_config(self) -> GPTConfig:
        return self.parts.model.config

    @property
    def tokens_per_step(self) -> int:
        cfg = self.cfg
        return cfg.batch_size * cfg.grad_accum * self.model_config.block_size * self.runtime.dist.world_size


def set_up(
    plan: RunPlan,
    dist: DistContext,
    reporter: ProgressReporter,
    *,
    started: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    make_sampler: SamplerFactory = BatchSampler,
) -> TrainingRun:
    """Data, model, optimizer, sampler and state (restored on a resume; a new run's directory created),
    the budget's clock started at `started` (a clock reading; None: now), and the reporter told."""
    cfg, runtime, dataset = _prepare(plan, dist, reporter)
    model = _build_model(plan, cfg, dataset.tokenizer, runtime.device)
    sampler = make_sampler(
        dataset.train, model.config.block_size, cfg.batch_size, cfg.seed, dist.rank, dist.world_size
    )
    parts = Trainables(model, make_optimizer(model, cfg, runtime.device), sampler)
    rundir = RunDir(plan.out)
    state = TrainState()
    if plan.resume:
        state = load_checkpoint(rundir, parts)
        reporter.log(f"resuming {plan.out} at step {state.step:,} ({state.tokens:,} tokens)")
        cfg = keep_global_batch(cfg, state.world_size, dist.world_size, reporter)
    state.world_size = dist.world_size
    settings = {"train": cfg.to_dict(), "data": data_dict(plan.data), "metrics": {}}
    if dist.is_master and not plan.resume:
        if plan.overwrite:
            rundir.clear()
        rundir.save(model, dataset.tokenizer, settings, save_weights=False)
    forward = dist.wrap(model, runtime.device)
    if cfg.compile:
        forward = torch.compile(forward)
    # steps logged after the checkpoint a resume starts from are trained again: their records go
    history = rundir.rewind_metrics(state.step) if plan.resume and dist.is_master else []
    budget = Budget.of(cfg, clock)
    budget.start(started, state.elapsed)
    run = TrainingRun(cfg, rundir, runtime, dataset, parts, forward, state, budget, settings, history)
    reporter.start(_training_start(run))
    return run


def _prepare(
    plan: RunPlan, dist: DistContext, reporter: ProgressReporter
) -> tuple[TrainConfig, Runtime, Dataset]:
    device = resolve_device(plan.cfg.device, local_rank=dist.local_rank)
    cfg = plan.cfg.with_recipe(device.type)
    torch.manual_seed(cfg.seed)
    planned = plan.shape or cfg.model_config(1)
    runtime = Runtime(device, resolve_dtype(cfg.dtype, device, training_width=planned.n_embd), dist)
    progress = dist.is_master and reporter.data_progress
    with dist.master_first():
        dataset = prepare_data(plan.data, planned.block_size, tokenizer=plan.tokenizer, progress=progress)
    return cfg, runtime, dataset


def _build_model(plan: RunPlan, cfg: TrainConfig, tokenizer: Tokenizer, device: torch.device) -> GPT:
    """A fresh model of the planned shape, with `init_from`'s weights when fine-tuning."""
    shape = plan.shape or cfg.model_config(tokenizer.vocab_size)
    if tokenizer.vocab_size > shape.vocab_size:
        raise MinigptError("tokenizer is larger than the model's vocabulary")
    model = GPT(shape).to(device)
    if plan.init_from is not None:
        source = RunDir(plan.init_from)
        weights = build_model(shape, source.load_weights(shape), source.weights_path, str(device))
        model.load_state_dict(weights.state_dict())
    model.train()
    return model


def _training_start(run: TrainingRun) -> TrainingStart:
    cfg, runtime = run.cfg, run.runtime
    return TrainingStart(
        out=run.rundir.path,
        model=run.model_config,
        n_params=count_params(run.model_config).exact_total,
        tokenizer=run.dataset.tokenizer.describe(),
        train_tokens=len(run.dataset.train),
        val_tokens=len(run.dataset.val),
        device=str(runtime.device),
        dtype=str(runtime.dtype).removeprefix("torch."),
        world_size=runtime.dist.world_size,
        batch_size=cfg.batch_size,
        grad_accum=cfg.grad_accum,
        budget=run.budget.describe(),
    )
