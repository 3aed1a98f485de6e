"""Setting up a training run: its settings (new, resumed or fine-tuned), data, model, optimizer and state."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.chat.data import ConversationData, conversation_files
from minigpt.common.device import resolve_device, resolve_dtype
from minigpt.common.settings import options_of
from minigpt.corpus.ingest import Share
from minigpt.corpus.inputs import collect_files
from minigpt.data.dataset import (
    BatchSampler,
    DataConfig,
    Dataset,
    changed_inputs,
    find_inputs,
    prepare_data,
    prepare_tokenizer,
)
from minigpt.errors import MinigptError, UsageError
from minigpt.feedback.plan import data_kind, make_objective, planned_memory, prepare_jsonl
from minigpt.feedback.records import CONVERSATIONS
from minigpt.generate.engines.tuning import ThreadTuner, machine
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.init import zero_output_projections
from minigpt.model.memory import FLOAT32, Allocating, allocating, check_fits, state_bytes, training_bytes
from minigpt.model.params import count_params
from minigpt.runs.folder import DEFAULT_ROOT, AdapterLink, RunDir
from minigpt.tokenizer.base import Tokenizer
from minigpt.train import spin
from minigpt.train.budget import EXIT_SECONDS, STEP_FORWARDS, Budget, EvalCost
from minigpt.train.checkpoint import Trainables, TrainState, load_checkpoint
from minigpt.train.config import BUDGET_SETTINGS, TrainConfig
from minigpt.train.distributed import DistContext
from minigpt.train.finetune import adapter_settings, full_model, lora_model, plan_fine_tune
from minigpt.train.finetune import describe as describe_lora
from minigpt.train.objective import NextToken, Objective
from minigpt.train.optimizers import make_optimizer
from minigpt.train.reporters import ProgressReporter, TrainingStart
from minigpt.train.step import Runtime
from minigpt.train.tuning import choose_precision, describe_threads, step_threads

# a first guess at how fast a checkpoint (weights, and the state: weights and two AdamW moments) is saved,
# replaced by the measured time after the first evaluation
SAVE_BYTES_PER_SECOND = 200e6

__all__ = ["EXIT_SECONDS", "RunPlan", "TrainingRun", "check_launch", "plan_run", "set_up"]

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
    replaced_budget: str | None = None  # a resume given a new budget: the saved one, in words
    saved_inputs: list[Any] | None = None  # a resumed run's recorded input files (path, stamp)
    allow_data_change: bool = False  # resume even if the text is not what the run trained on
    lora: AdapterLink | None = None  # a LoRA run's adapter: its settings and frozen base
    kind: str | None = None  # what a new run's JSONL files hold (None: text, or a resume)


def plan_run(
    cfg: TrainConfig,
    data: DataConfig | None = None,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    init_from: Path | None = None,
    overwrite: bool = False,
    allow_data_change: bool = False,
) -> RunPlan:
    """A new run on `data` (into `out`, refused if it holds a run unless `overwrite`), a resume of `resume`
    (with its saved settings; a budget in `cfg` replaces the saved one), or a run starting from
    `init_from`'s weights and tokenizer."""
    if resume is not None:
        paths = data.paths if data is not None else ()
        return _plan_resume(cfg, resume, paths, allow_data_change, out=out, init_from=init_from)
    if data is None:
        raise UsageError("give the text to train on (a DataConfig), or a run to resume")
    if not cfg.has_budget:
        raise UsageError("give a budget: max_iters, max_time or max_tokens")
    out = out if out is not None else DEFAULT_ROOT / _default_name(data)
    RunDir(out).guard_new(overwrite)
    chat = conversation_files(data.paths)
    kind = data_kind(cfg, chat, init_from)
    if init_from is None:
        if cfg.lora_rank is not None:
            raise UsageError("LoRA trains adapters on a trained run: name it with --init-from RUN")
        return RunPlan(cfg, data, out, overwrite=overwrite, kind=kind)
    # the shape is the source run's (with rows for the chat tokens conversations need); dropout is a
    # training choice, so cfg's applies
    shaped = [name for name in ("preset", "arch") if getattr(cfg, name) is not None]
    shaped += [name for name in cfg.overrides if name != "dropout"]
    if shaped:
        flags = {o.name: o.flag for o in options_of(TrainConfig)}
        drop = ", ".join(flags[name] for name in shaped)
        raise UsageError(f"--init-from takes the model's shape from that run: drop {drop}")
    tokenizer, shape, lora = plan_fine_tune(init_from, cfg, chat is not None)
    return RunPlan(cfg, data, out, False, init_from, overwrite, tokenizer, shape, lora=lora, kind=kind)


def _plan_resume(
    cfg: TrainConfig,
    resume: Path,
    paths: tuple[Path, ...] = (),
    allow_data_change: bool = False,
    **others: Any,
) -> RunPlan:
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
    shape = source.model_config(saved)  # checked against the weights before anything else is read
    if not source.has_state():
        raise MinigptError(f"{resume} has no {RunDir.STATE}: nothing to resume")
    saved_cfg = TrainConfig.from_dict(saved["train"])
    replaced = None
    if cfg.has_budget:
        replaced = Budget(**saved_cfg.budget()).describe()
        saved_cfg = saved_cfg.with_budget(cfg.budget())
    data, inputs = _saved_data(saved.get("data"), source, paths)
    return RunPlan(
        saved_cfg, data, resume, True, tokenizer=source.tokenizer(), shape=shape, replaced_budget=replaced,
        saved_inputs=inputs, allow_data_change=allow_data_change, lora=source.adapter_link(saved),
    )  # fmt: skip


def _saved_data(saved: Any, source: RunDir, paths: tuple[Path, ...]) -> tuple[DataConfig, list[Any] | None]:
    """The data settings a run recorded, read at `paths` when the text moved (its content is checked once
    hashed); the cache folder is this machine's, never one a config.json names."""
    if not isinstance(saved, dict) or not isinstance(saved.get("paths"), list):
        raise MinigptError(f"{source.config_path}: the data section is damaged; resume is not possible")
    known = {o.name for o in options_of(DataConfig)}
    settings = {k: v for k, v in saved.items() if k in known}
    recorded, settings["val_file"] = _recorded_paths(saved)
    moved = tuple(paths) or recorded
    missing = [p for p in moved if not p.exists()]
    if missing and not paths:
        raise MinigptError(
            f"{missing[0]}, which {source} was trained on, is not there: give its new place, "
            f"minigpt train --resume {source} FILE..."
        )
    try:
        return DataConfig(paths=moved, **settings), saved.get("inputs")
    except TypeError as e:
        raise MinigptError(f"{source.config_path}: the data section is damaged ({e})") from None


def _recorded_paths(saved: dict[str, Any]) -> tuple[tuple[Path, ...], Path | None]:
    """The training paths and validation file a run recorded. They are absolute; a run saved before they
    were kept the paths as given (relative to wherever that command ran), and for those the absolute path
    each input file had ("inputs") stands in, when every one of them is still there."""
    paths = tuple(Path(str(p)) for p in saved["paths"])
    val = Path(str(saved["val_file"])) if saved.get("val_file") else None
    inputs = [r for r in saved.get("inputs") or [] if isinstance(r, dict) and isinstance(r.get("path"), str)]
    given = [*paths, *([val] if val else [])]
    if all(p.is_absolute() for p in given) or not inputs:
        return paths, val
    found = {role: [Path(r["path"]) for r in inputs if r.get("role") == role] for role in ("train", "val")}
    if not found["train"] or not all(p.is_absolute() and p.is_file() for p in found["train"] + found["val"]):
        return paths, val
    return tuple(found["train"]), (found["val"][0] if val and len(found["val"]) == 1 else val)


def check_launch(nproc: int, plan: RunPlan) -> None:
    """What `train --nproc N` can check before starting N processes: input files and one GPU per process
    (plan_run has checked the settings and the run directory)."""
    collect_files([*plan.data.paths, *([plan.data.val_file] if plan.data.val_file else [])])
    if plan.kind is not None and plan.kind != CONVERSATIONS:
        raise UsageError(f"learning from {plan.kind} runs in one process: drop --nproc")
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
    # absolute, so that a resume from any folder finds the text, whatever form the paths were given in
    d["paths"] = [str(p.absolute()) for p in data.paths]
    d["val_file"] = str(data.val_file.absolute()) if data.val_file else None
    d["cache_dir"] = str(data.cache_dir) if data.cache_dir else None
    return d


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
    dataset: Dataset | ConversationData
    parts: Trainables  # the bare model, optimizer and sampler: what a checkpoint saves
    forward: torch.nn.Module  # the model as evaluations call it (under DDP, the wrapped model)
    step_forward: torch.nn.Module  # the model as training steps call it: `forward`, compiled with --compile
    state: TrainState
    budget: Budget
    settings: dict[str, Any]  # config.json's train, data, metrics and machine sections
    history: list[dict[str, Any]]  # every metrics record of the run, earlier commands' included
    objective: Objective  # what it trains for: the next token, preferences or a reward
    threads: ThreadTuner | None = None  # the CPU's: steps timed on each thread count (minigpt.train.tuning)

    @property
    def model_config(self) -> GPTConfig:
        return self.parts.model.config

    @functools.cached_property
    def step_allocation(self) -> Allocating:
        """What a training step allocates, for the one-line error if it runs out of memory."""
        shape = self.model_config
        rows, extra = planned_memory(self.cfg, shape, self.dataset, self.parts.model.lora)
        what = f"a training step on {rows:,} x {shape.block_size:,} tokens (activations, gradients)"
        return Allocating(what, training_bytes(shape, rows) + extra)

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step reads: a row (window, conversation, pair, task) each as the objective counts it."""
        cfg, row = self.cfg, self.objective.row_tokens(self.model_config.block_size)
        return cfg.batch_size * cfg.grad_accum * row * self.runtime.dist.world_size


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
    try:
        return _set_up_with(plan, dist, reporter, cfg, runtime, dataset, started, clock, make_sampler)
    except BaseException:
        dataset.close()  # tokenizing beside training stops with it
        raise


def _set_up_with(
    plan: RunPlan,
    dist: DistContext,
    reporter: ProgressReporter,
    cfg: TrainConfig,
    runtime: Runtime,
    dataset: Dataset,
    started: float | None,
    clock: Callable[[], float],
    make_sampler: SamplerFactory,
) -> TrainingRun:
    model = _build_model(plan, cfg, dataset, runtime.device)
    threads = step_threads(cfg.threads) if runtime.device.type == "cpu" else None
    cfg, runtime, choices = _machine_choices(cfg, runtime, model, threads)
    objective = make_objective(cfg, dataset, model, runtime, fresh=not plan.resume)
    if dist.enabled and not isinstance(objective, NextToken):
        raise UsageError("learning from preference pairs or tasks runs in one process: drop --nproc")
    sampler = _make_batch_sampler(cfg, dist, dataset, model.config.block_size, make_sampler)
    parts = Trainables(model, make_optimizer(model, cfg, runtime.dtype), sampler, objective.reference)
    rundir = RunDir(plan.out)
    state, cfg = _starting_state(plan, dist, reporter, cfg, rundir, parts)
    _check_same_text(plan, dataset)
    settings = {**_run_settings(plan, cfg, dataset), "machine": choices}
    if dist.is_master and not plan.resume:
        if plan.overwrite:
            rundir.clear()
        rundir.save(model, dataset.tokenizer, settings, save_weights=False)
    forward = dist.wrap(model, runtime.device)
    # evaluations run uncompiled: their batch shapes differ from a step's, and each would compile anew
    step_forward = torch.compile(forward) if cfg.compile else forward
    # steps logged after the checkpoint a resume starts from are trained again: their records go
    history = rundir.rewind_metrics(state.step) if plan.resume and dist.is_master else []
    budget = Budget.of(cfg, state, clock)
    budget.start(started, state.elapsed)
    run = TrainingRun(
        cfg,
        rundir,
        runtime,
        dataset,
        parts,
        forward,
        step_forward,
        state,
        budget,
        settings,
        history,
        objective,
        threads,
    )
    _reserve_time(run)
    reporter.start(_training_start(run, plan))
    return run


def _machine_choices(
    cfg: TrainConfig, runtime: Runtime, model: GPT, threads: ThreadTuner | None
) -> tuple[TrainConfig, Runtime, dict[str, Any]]:
    """On the CPU, the settings this machine decides (minigpt.train.tuning): the autocast dtype, Muon's and
    attention's, filled into the run's settings (so a resume keeps them), and config.json's record of every choice,
    the OpenMP spin the command line set before torch loaded included."""
    if threads is None:
        return cfg, runtime, {}
    precision = choose_precision(cfg, model, runtime, threads)
    attention = precision.attention_dtype
    cfg = replace(
        cfg, dtype=precision.dtype, muon_dtype=precision.muon_dtype or cfg.muon_dtype,
        attention_dtype=attention or cfg.attention_dtype,
    )  # fmt: skip
    runtime = replace(
        runtime, dtype=getattr(torch, precision.dtype), attention_dtype=getattr(torch, attention or "float32")
    )
    record = {
        "cpu": machine(),
        "torch": torch.__version__,
        "precision": precision.record(),
        "threads": describe_threads(threads),
        "openmp_spin": spin.describe(),
        "summary": f"{precision.describe()}; {describe_threads(threads)}; {spin.describe()}",
    }
    return cfg, runtime, record


def _make_batch_sampler(
    cfg: TrainConfig, dist: DistContext, dataset: Dataset, block_size: int, make_sampler: SamplerFactory
) -> BatchSampler:
    """This rank's sampler of training batches: `make_sampler`'s windows of text, or whole conversations
    (pairs, tasks)."""
    if isinstance(dataset, ConversationData):
        if cfg.seq_ramp:
            raise UsageError("--seq-ramp grows windows of text; conversations train whole: drop --seq-ramp")
        make_sampler = dataset.sampler_class
    sampler = make_sampler(
        dataset.train,
        block_size,
        cfg.batch_size,
        cfg.seed,
        dist.rank,
        dist.world_size,  # type: ignore[arg-type]
    )
    # a run that starts before its corpus is tokenized follows the availability schedule (every rank alike);
    # a resume takes what its checkpoint says
    sampler.ramp, _ = dist.agree_stop(not dataset.tokenized_at_start)
    return sampler


def _starting_state(
    plan: RunPlan,
    dist: DistContext,
    reporter: ProgressReporter,
    cfg: TrainConfig,
    rundir: RunDir,
    parts: Trainables,
) -> tuple[TrainState, TrainConfig]:
    """A new run's empty state, or a resumed run's checkpoint loaded into `parts`, with the settings it
    trains on (the global batch kept when the number of processes changed)."""
    state = TrainState()
    if plan.resume:
        state = load_checkpoint(rundir, parts)
        reporter.log(f"resuming {plan.out} at step {state.step:,} ({state.tokens:,} tokens)")
        cfg = keep_global_batch(cfg, state.world_size, dist.world_size, reporter)
        if plan.replaced_budget is not None:
            state.time_budget_from = state.elapsed  # a new time budget counts this command's time
    state.world_size = dist.world_size
    return state, cfg


def _run_settings(plan: RunPlan, cfg: TrainConfig, dataset: Dataset) -> dict[str, Any]:
    """What config.json records of how the run trains: its settings, its data and (LoRA) its adapter."""
    settings: dict[str, Any] = {
        "train": cfg.to_dict(),
        "data": {**data_dict(plan.data), "inputs": list(dataset.inputs)},
        "metrics": {},
    }
    if plan.lora is not None:
        settings["adapter"] = adapter_settings(plan.lora)
    return settings


def _prepare(
    plan: RunPlan, dist: DistContext, reporter: ProgressReporter
) -> tuple[TrainConfig, Runtime, Dataset]:
    device = resolve_device(plan.cfg.device, local_rank=dist.local_rank)
    cfg = plan.cfg.with_recipe(device.type, plan.kind)
    torch.manual_seed(cfg.seed)
    planned = plan.shape or cfg.model_config(1)
    runtime = Runtime(device, resolve_dtype(cfg.dtype, device), dist, eval_chunk=cfg.eval_chunk or 0)
    progress = dist.is_master and reporter.data_progress
    chat = conversation_files(plan.data.paths)
    if chat is not None:  # fine-tuning on conversations: one process per machine tokenizes them
        note = reporter.log if progress else (lambda message: None)
        with dist.master_first():
            data = prepare_jsonl(plan.data, chat, cfg, planned.block_size, plan.tokenizer, note)
        return cfg, runtime, data  # type: ignore[return-value]
    # each process of a machine tokenizes its share of the files into the shared store, beside training
    share = Share(dist.local_rank, dist.local_world_size)
    inputs = find_inputs(plan.data, progress, share)
    with dist.master_first():  # one process per machine learns (or loads) the tokenizer, the others read it
        tokenizer = plan.tokenizer or prepare_tokenizer(plan.data, inputs, progress)
    dataset = prepare_data(
        plan.data, planned.block_size, tokenizer, progress, background=True, share=share, inputs=inputs
    )
    return cfg, runtime, dataset


def _check_same_text(plan: RunPlan, dataset: Dataset) -> None:
    """On resume, the text must be what the run trained on (by content), unless the user says otherwise."""
    change = changed_inputs(plan.saved_inputs, dataset.inputs, plan.data.cache_root) if plan.resume else None
    if change and not plan.allow_data_change:
        raise MinigptError(
            f"the text differs from what {plan.out} was trained on ({change}): pass the original files, or "
            f"--allow-data-change to go on with this text (the saved best loss came from the old split)"
        )


def _build_model(
    plan: RunPlan, cfg: TrainConfig, dataset: Dataset | ConversationData, device: torch.device
) -> GPT:
    """A fresh model of the planned shape, with `init_from`'s weights when fine-tuning (LoRA: the base's,
    frozen, with adapters); first, the memory it, a micro-batch and the objective will need, against what
    the machine has."""
    tokenizer = dataset.tokenizer
    shape = plan.shape or cfg.model_config(tokenizer.vocab_size)
    if tokenizer.vocab_size > shape.vocab_size:
        raise MinigptError("tokenizer is larger than the model's vocabulary")
    smaller = "pick a smaller model (--preset, --n-layer, --n-embd)"
    if device.type == "cpu":
        fix = "lower batch_size, block_size or the model's size"
        rows, extra = planned_memory(cfg, shape, dataset, plan.lora.lora if plan.lora is not None else None)
        check_fits(training_bytes(shape, rows) + extra, f"training with batch_size {cfg.batch_size:,}", fix)
    else:  # the estimate's activations are the CPU's (attention's T x T scores kept); a GPU's fused attention
        # keeps none, so only the float32 state is checked first and the allocator's error names the rest
        what = "the model's state (weights, gradients, AdamW's moments)"
        check_fits(state_bytes(shape), what, smaller, device)
    n_params = count_params(shape).exact_total
    with allocating(f"the model's {n_params:,} parameters", n_params * FLOAT32, smaller):
        if plan.lora is not None:
            model = lora_model(shape, plan.lora, plan.out, device, fresh=not plan.resume)
        elif plan.init_from is not None:
            model = full_model(shape, plan.init_from, device)
        else:
            model = GPT(shape).to(device)
            if cfg.zero_init:
                zero_output_projections(model)
    model.train()
    return model


def _reserve_time(run: TrainingRun) -> None:
    """Before the first evaluation, size the evaluations to the time budget and keep time for the final
    one, from a timed forward pass and a guess at the save, agreed with the other ranks along with the
    clock."""
    cfg, budget = run.cfg, run.budget
    batch = cfg.batch_size * cfg.grad_accum
    budget.step_windows = batch
    if budget.max_time is not None:
        budget.eval_cost = run.objective.eval_cost(
            run.forward, run.model_config, run.dataset, cfg.batch_size, run.runtime, budget.clock
        )
        budget.save_seconds = 16 * count_params(run.model_config).exact_total / SAVE_BYTES_PER_SECOND
        budget.keep_reserve()
    else:  # untimed: the evaluation's size only, for the one a signal cuts short (Budget.eval_iters_now)
        windows = run.objective.split_windows(run.model_config, run.dataset, run.runtime)
        budget.eval_cost = EvalCost(0.0, cfg.batch_size, windows)
    _, (run.state.elapsed, *shared) = run.runtime.dist.agree_stop(False, budget.elapsed(), *budget.shared())
    budget.adopt(shared)
    # so that a first step that cannot finish within the budget (a big model on a loaded machine) is not begun
    budget.step_estimate = STEP_FORWARDS * budget.eval_cost.window_seconds * batch


def _training_start(run: TrainingRun, plan: RunPlan) -> TrainingStart:
    budget = run.budget.describe()
    if isinstance(run.dataset, Dataset):
        run.dataset.refresh()  # tokenizing may have finished beside start-up: the header counts all of it
    if plan.replaced_budget is not None:
        budget += f" (set on resume, in place of the saved {plan.replaced_budget})"
    elif plan.resume:
        budget += " (as saved)"
    cfg, runtime, dataset = run.cfg, run.runtime, run.dataset
    total = count_params(run.model_config).exact_total
    return TrainingStart(
        out=run.rundir.path,
        model=run.model_config,
        n_params=total,
        tokenizer=run.dataset.tokenizer.describe(),
        train_tokens=len(run.dataset.train),
        val_tokens=len(run.dataset.val),
        data_status=run.dataset.status if not run.dataset.complete else None,
        device=str(runtime.device),
        dtype=str(runtime.dtype).removeprefix("torch."),
        world_size=runtime.dist.world_size,
        batch_size=cfg.batch_size,
        grad_accum=cfg.grad_accum,
        budget=budget,
        start=replace(run.state),
        start_progress=run.budget.progress(run.state),
        elapsed=run.state.elapsed,
        data=dataset.summary if isinstance(dataset, ConversationData) else None,
        fine_tune=describe_lora(plan.lora, run.model_config, total) if plan.lora is not None else None,
        machine=run.settings.get("machine", {}).get("summary"),
    )
