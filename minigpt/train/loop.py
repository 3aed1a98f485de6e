"""Training as a function over typed configs: set up, then step, evaluate and checkpoint until the budget ends."""

from __future__ import annotations

import contextlib
import hashlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minigpt.chat.data import ConversationData
from minigpt.data.dataset import BatchSampler, DataConfig, Dataset
from minigpt.errors import Interrupted, MinigptError
from minigpt.model.memory import labelled
from minigpt.runs.folder import RunDir
from minigpt.runs.usage import example_prompt
from minigpt.train.budget import STOP_EVAL_SECONDS, batch_at, lr_at, window_at
from minigpt.train.checkpoint import TrainState, save_checkpoint
from minigpt.train.config import DEFAULT_MAX_ITERS, LaunchConfig, TrainConfig, parse_duration
from minigpt.train.distributed import DistContext
from minigpt.train.reporters import ProgressReporter, QuietReporter, TrainingEnd
from minigpt.train.run import SamplerFactory, TrainingRun, check_launch, plan_run, set_up
from minigpt.train.step import train_step
from minigpt.train.tuning import STEP_KEY

__all__ = ["TrainConfig", "TrainResult", "TrainState", "check_launch", "parse_duration", "plan_run", "train"]

TRY_PROMPT_TOKENS = 256  # of the training text, decoded to find its first line's opening words


@dataclass
class TrainResult:
    out: Path
    state: TrainState
    interrupted: bool
    stop_reason: str
    metrics: list[dict[str, Any]]


def command_arguments(
    files: Sequence[Path] | None,
    cfg: TrainConfig,
    data_options: dict[str, Any],
    launch: LaunchConfig,
    changed: Sequence[str],
) -> dict[str, Any]:
    """`train`'s arguments for `minigpt train FILES` (a new run, given the default budget where it has none),
    or for `--resume`, where only the budget and the text's new place may change: `changed` names any other
    setting given, refused."""
    if launch.resume is not None:
        if changed:
            raise MinigptError(
                f"--resume continues a run with its saved settings; only budget options and the text's new "
                f"place may change (got {', '.join(changed)})",
                exit_code=2,
            )
        moved = DataConfig(paths=tuple(files), tokenizer="char") if files else None  # only its paths count
        return dict(
            cfg=cfg, data=moved, resume=launch.resume, allow_data_change=launch.allow_data_change
        )  # fmt: skip
    if not files:
        raise MinigptError("give a text file to train on (or --resume DIR): minigpt train FILE", exit_code=2)
    cfg = cfg if cfg.has_budget else cfg.with_budget({"max_iters": DEFAULT_MAX_ITERS})
    data = DataConfig(paths=tuple(files), **data_options)
    return dict(cfg=cfg, data=data, out=launch.out, init_from=launch.init_from, overwrite=launch.overwrite)


def train(
    cfg: TrainConfig,
    data: DataConfig | None = None,
    *,
    out: Path | None = None,
    resume: Path | None = None,
    init_from: Path | None = None,
    overwrite: bool = False,
    allow_data_change: bool = False,
    reporter: ProgressReporter | None = None,
    on_step: Callable[[int], None] | None = None,
    started: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    make_sampler: SamplerFactory = BatchSampler,
) -> TrainResult:
    """Train a model (new, resumed from `resume`, or starting from `init_from`'s weights) and save it.

    On a resume `cfg` holds nothing or a new budget, which replaces the saved one, and `data`, if given, only
    says where the run's text is now (it must be the same text unless `allow_data_change`). The time budget counts
    from `started` (a `clock()` reading; default: this call), so the CLI makes it the wall time of the whole
    command. `reporter` (rank 0's; default: silent) is told the progress, `on_step` each step's number.
    """
    command_started = clock() if started is None else started
    plan = plan_run(
        cfg, data, out=out, resume=resume, init_from=init_from, overwrite=overwrite,
        allow_data_change=allow_data_change,
    )  # fmt: skip
    # every rank checks its settings before joining; rank 0 writes nothing until all have joined
    dist = DistContext.from_env(plan.cfg.device)
    reporter = reporter if reporter is not None and dist.is_master else QuietReporter()
    # rank 0 writes the run, so it holds the run's lock: a second writer gets a one-line error
    with RunDir(plan.out).lock() if dist.is_master else contextlib.nullcontext():
        run = set_up(plan, dist, reporter, started=command_started, clock=clock, make_sampler=make_sampler)
        try:
            reason, interrupted = run_loop(run, reporter, on_step)
        except KeyboardInterrupt:  # a second Ctrl-C: out at once, saying what that costs
            reporter.close()
            raise Interrupted(_discarded(run)) from None
        except BaseException:
            reporter.close()
            raise
        finally:
            run.dataset.close()  # tokenizing beside training stops; its finished chunks stay in the store
    reporter.finish(_training_end(run, reason, interrupted, clock() - command_started))
    dist.close()
    return TrainResult(run.rundir.path, run.state, interrupted, reason, run.history)


def run_loop(
    run: TrainingRun, reporter: ProgressReporter, on_step: Callable[[int], None] | None = None
) -> tuple[str, bool]:
    """Step, log, evaluate and checkpoint until the budget ends or a signal asks to stop, then evaluate and
    checkpoint once more: why it stopped, and whether a signal stopped it."""
    state, budget, first_step = run.state, run.budget, run.state.step
    signals = StopSignals(grace=1.0 if run.runtime.dist.enabled else 0.0, on_request=reporter.stop_requested)
    reason, interrupted = budget.stop_reason(state), False
    with signals.installed(), run.runtime.dist.peer_errors(run.rundir.path):
        # one process can give a long step up between micro-batches; ranks would have to agree on it
        abandon = (
            None
            if run.runtime.dist.enabled
            else lambda: signals.requested is not None or budget.out_of_time()
        )
        while reason is None:
            step_started = run.budget.clock()
            loss, lr = _step_on_threads(run, reporter, abandon, timed=state.step > first_step)
            if loss is None:
                interrupted = signals.requested is not None
                reason = (
                    f"stopped by {signals.requested}" if interrupted else "reached max_time within a step"
                )
                break
            if on_step is not None:
                on_step(state.step)
            # the first step of a command pays one-off costs, so it does not count towards the step time
            timed = state.step > first_step + 1
            stop_asked = _sync_clock(
                run, signals.requested is not None, run.budget.clock() - step_started, timed
            )
            if state.step % run.cfg.log_every == 0 or state.step == 1:
                _log_step(run, reporter, loss, lr)
            reason = budget.stop_reason(state)
            if stop_asked:
                interrupted, reason = True, f"stopped by {signals.requested or 'a signal on another rank'}"
            if reason is None and state.step % run.cfg.eval_every == 0:
                evaluate_and_save(run, reporter)
        evaluate_and_save(run, reporter, final=True, stopping=interrupted)
    return reason, interrupted


def _step_on_threads(
    run: TrainingRun, reporter: ProgressReporter, abandon: Callable[[], bool] | None, timed: bool
) -> tuple[float | None, float]:
    """take_step on the thread count the run's tuner picks (on the CPU), timed for it unless the step is
    a command's first (its one-off costs would count against that count); a new choice is logged."""
    tuner = run.threads
    if tuner is None or not timed:
        return take_step(run, abandon)
    before = tuner.chosen(STEP_KEY)
    with tuner.step(STEP_KEY):
        result = take_step(run, abandon)
    after = tuner.chosen(STEP_KEY)
    if after != before and after is not None:
        reporter.log(
            f"threads: {after} from step {run.state.step + 1:,}"
            + (f" (was {before}: steps timed on each count)" if before is not None else "")
        )
    return result


def take_step(run: TrainingRun, abandon: Callable[[], bool] | None = None) -> tuple[float | None, float]:
    """One optimizer step at the scheduled learning rate, the state advanced past it: (loss, lr); a loss of
    None when `abandon` gave the step up between micro-batches (the state stays as it was).

    A loss that is not finite stops the run; the weights and the last checkpoint stay as they were.
    """
    cfg, state, dist = run.cfg, run.state, run.runtime.dist
    if dist.enabled and run.model_config.dropout > 0:
        # each rank its own dropout masks, reproducible from the step alone (so on any process count)
        torch.manual_seed(_step_seed(cfg.seed, dist.rank, state.step))
    warmup = run.budget.warmup_steps(cfg.warmup, state, run.tokens_per_step)
    if state.warmup_steps < 0 and state.step + 1 >= warmup:
        state.warmup_steps = warmup  # this step ends the ramp: what the recipe records as the run's warmup
    progress = run.budget.progress(state)
    lr = lr_at(cfg, state.step, progress, warmup)
    optimizer, sampler = run.parts.optimizer, run.parts.sampler
    sampler.batch_size = batch = batch_at(cfg, progress)
    sampler.block_size = window = window_at(cfg, run.model_config.block_size, progress)
    assert cfg.grad_clip is not None, "take_step needs a resolved config (with_recipe)"
    with labelled(run.step_allocation):
        loss = train_step(
            run.step_forward,
            optimizer,
            sampler,
            run.runtime,
            lr=lr,
            grad_accum=cfg.grad_accum,
            grad_clip=cfg.grad_clip,
            abandon=abandon,
            loss_of=run.objective.loss,
        )
    if loss is None:
        return None, lr
    if not math.isfinite(loss):
        raise MinigptError(
            f"loss became {loss} at step {state.step}: lower lr (now {cfg.lr:g}) or raise warmup; "
            f"the last good checkpoint in {run.rundir} is untouched"
        )
    state.step += 1
    state.tokens += run.tokens_per_step * batch * window // (cfg.batch_size * run.model_config.block_size)
    return loss, lr


def evaluate_and_save(
    run: TrainingRun, reporter: ProgressReporter, final: bool = False, stopping: bool = False
) -> None:
    """Evaluate, record it, and checkpoint (the best weights too when validation improved), with as many
    batches as the time budget allows (see Budget.eval_iters_now), or a few seconds' worth when a signal
    stopped the run (`stopping`). A periodic evaluation that does not fit is skipped, and so is one that the
    final one would follow within half of eval_every steps (it would show what the final one shows, at the
    cost of steps a short run cannot spare); a final one that does not
    fit still saves, and a run never evaluated keeps these weights. What it took is measured for the next
    ones and for the time kept back for the final one."""
    budget, state = run.budget, run.state
    iters, started = budget.eval_iters_now(state, final, stopping), budget.clock()
    if iters and not final and (away := _final_within_half(run, iters)) is not None:
        reporter.log(
            f"skipped the evaluation at step {state.step:,}: the final one is {away:,} step"
            f"{'s' if away != 1 else ''} away"
        )
        return
    record: dict[str, Any] | None = None
    if stopping and iters:
        reporter.log(f"stopping: evaluating and saving step {state.step:,}…")
    if iters:
        record, improved = _evaluate(run, iters, reporter)
    elif final:
        improved = not math.isfinite(state.best_val_loss)  # never evaluated: these weights are the model
        reporter.log(
            f"stopping: saving step {state.step:,} without a final evaluation (a stopped run evaluates for "
            f"at most {STOP_EVAL_SECONDS:g} s, and this one's would take longer or is not timed yet; "
            f"minigpt eval scores the run)…"
            if stopping
            else f"no time left for the final evaluation at step {state.step:,}: saved without it"
        )
    else:
        reporter.log(f"skipped the evaluation at step {state.step:,}: it would not finish within max_time")
        return
    _keep_metrics(
        run, record or {"step": state.step, "tokens": state.tokens, "elapsed": round(state.elapsed, 3)}
    )
    evaluated = budget.clock()
    if run.runtime.dist.is_master:
        reporter.phase(f"saving step {state.step:,}")
        save_checkpoint(run.rundir, run.parts, run.dataset.tokenizer, state, run.settings, improved)
    reporter.phase("")
    if record is not None:
        reporter.evaluated(record, improved)
    run.runtime.dist.barrier()
    budget.observe_eval(evaluated - started, budget.eval_cost.windows(iters), budget.clock() - evaluated)


def _final_within_half(run: TrainingRun, iters: int) -> int | None:
    """The steps to the final evaluation when it would follow an evaluation of `iters` batches now within
    half of eval_every steps (that evaluation's own time taken out of the budget), else None."""
    budget, state, tokens = run.budget, run.state, run.tokens_per_step
    after = budget.steps_left(state, tokens, busy=budget.eval_cost.seconds(iters))
    if after is None or after >= run.cfg.eval_every / 2:
        return None
    return math.ceil(budget.steps_left(state, tokens) or 0.0)  # as they are if it is skipped


def _evaluate(run: TrainingRun, iters: int, reporter: ProgressReporter) -> tuple[dict[str, Any], bool]:
    """Evaluate on `iters` batches of windows (the reporter shown how far it is) and record it: the record,
    and whether validation improved."""
    cfg, state, dataset = run.cfg, run.state, run.dataset
    what, total, done = f"evaluating step {state.step:,}", run.budget.eval_cost.windows(iters), 0

    def tick(windows: int) -> None:
        nonlocal done
        done += windows
        reporter.phase(what, min(done, total), total)

    tick(0)
    losses = run.objective.evaluate(
        run.forward, run.model_config, dataset, cfg.batch_size, iters, run.runtime, tick
    )
    improved = state.record_eval(losses)
    record = {"step": state.step, "tokens": state.tokens, "elapsed": round(state.elapsed, 3), **losses}
    if iters != cfg.eval_iters:
        record["eval_iters"] = iters  # fewer batches than asked for, to keep within max_time
    run.history.append({"kind": "eval", **record})
    if run.runtime.dist.is_master:
        run.rundir.append_metrics({"kind": "eval", **record})
    return record, improved


def _keep_metrics(run: TrainingRun, last: dict[str, Any]) -> None:
    """config.json's metrics: the best validation so far (none before an evaluation) and where the run is."""
    state = run.state
    best = math.isfinite(state.best_val_loss)
    run.settings["metrics"] = {
        "best_val_loss": state.best_val_loss if best else None,
        "best_step": state.best_step if best else None,
        "best_val_bpb": run.objective.best_bpb(state.best_val_loss) if best else None,
        "warmup_steps": state.warmup_steps if state.warmup_steps >= 0 else None,
        "last": last,
    }
    words = run.objective.describe_best(state.best_val_loss) if best else None
    if words is not None:  # what the validation loss is, where it is not the next token's (DPO's, RL's)
        run.settings["metrics"]["best"] = words


def _sync_clock(run: TrainingRun, stop_requested: bool, step_seconds: float, timed: bool) -> bool:
    """Take rank 0's clock, time reserve and step time on every rank; whether any rank was asked to stop."""
    budget = run.budget
    stop, (run.state.elapsed, seconds, *shared) = run.runtime.dist.agree_stop(
        stop_requested, budget.elapsed(), step_seconds, *budget.shared()
    )
    budget.adopt(shared)
    if timed:
        budget.observe_step(seconds)
    return stop


def _log_step(run: TrainingRun, reporter: ProgressReporter, loss: float, lr: float) -> None:
    state = run.state
    record = {
        "step": state.step,
        "tokens": state.tokens,
        "elapsed": round(state.elapsed, 3),
        "loss": loss,
        "lr": lr,
        **run.objective.stats(),
    }
    run.history.append({"kind": "train", **record})
    if run.runtime.dist.is_master:
        run.rundir.append_metrics({"kind": "train", **record})
    reporter.step(record, run.budget.progress(state))


def _training_end(run: TrainingRun, reason: str, interrupted: bool, command_seconds: float) -> TrainingEnd:
    state = run.state
    elapsed = run.budget.elapsed()
    return TrainingEnd(
        out=run.rundir.path,
        state=state,
        reason=reason,
        interrupted=interrupted,
        elapsed=elapsed,
        command_seconds=command_seconds,
        overrun=run.budget.overrun(elapsed),
        best_val_bpb=run.objective.best_bpb(state.best_val_loss),
        best=run.objective.describe_best(state.best_val_loss),
        history=run.history,
        chat=isinstance(run.dataset, ConversationData),
        prompt=_try_prompt(run.dataset),
    )


def _try_prompt(dataset: Dataset | ConversationData) -> str:
    """A prompt from the start of the training text, for the command that tries the run (none for a chat)."""
    if isinstance(dataset, ConversationData):
        return ""
    start = dataset.train[:TRY_PROMPT_TOKENS].tolist()
    return example_prompt(dataset.tokenizer, dataset.tokenizer.decode(start))


def _discarded(run: TrainingRun) -> str:
    """What a second signal, which ends the run at once, discarded: the steps past the checkpoint on disk."""
    saved, step = run.rundir.checkpoint_step(), run.state.step
    resume = f"minigpt train --resume {run.rundir.path}"
    if saved is not None and saved >= step:
        return f"interrupted again: step {saved:,} is saved; resume with: {resume}"
    if saved is None:
        taken = f"its {step:,} step{'s' if step != 1 else ''} are lost" if step else "no step was taken"
        return f"interrupted again: not saved; the run has no checkpoint yet, so {taken}"
    lost = f"step {step:,}" if step == saved + 1 else f"steps {saved + 1:,}-{step:,}"
    return (
        f"interrupted again: not saved; {lost} since the last checkpoint at step {saved:,} "
        f"{'is' if step == saved + 1 else 'are'} lost; the run resumes from step {saved:,}: {resume}"
    )


def _step_seed(seed: int, rank: int, step: int) -> int:
    text = f"minigpt-dropout:{seed}:{rank}:{step}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


class StopSignals:
    """First Ctrl-C/SIGTERM asks the loop to stop after the current step (and tells `on_request` at once,
    from the handler); a second one exits at once.

    Under torchrun a Ctrl-C reaches each worker twice, from the terminal and relayed by the launcher a moment
    later, so there a repeat within `grace` seconds counts as the same request.
    """

    def __init__(
        self,
        grace: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self.requested: str | None = None
        self.grace = grace
        self.clock = clock
        self.on_request = on_request
        self._first = 0.0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            if self.clock() - self._first < self.grace:
                return
            # saves are atomic, so leaving mid-write cannot corrupt the previous checkpoint
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        self._first = self.clock()
        if self.on_request is not None:
            self.on_request(self.requested)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
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
