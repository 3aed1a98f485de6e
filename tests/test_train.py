"""Training end to end on tiny texts: checkpoints, exact resume, atomic saves, budgets, bad input."""

from __future__ import annotations

import io
import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ROOT, FakeClock
from rich.console import Console

from minigpt.cli.main import app
from minigpt.cli.training_display import TrainingDisplay
from minigpt.common.files import load_tensors
from minigpt.common.settings import nested_names, options_of
from minigpt.data.dataset import BatchSampler, DataConfig, prepare_data
from minigpt.errors import MinigptError, UsageError
from minigpt.model.config import ARCHS, GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.presets import PRESETS
from minigpt.model.weights import expected_shapes
from minigpt.runs.folder import RunDir
from minigpt.train import step
from minigpt.train.adamw import AdamW
from minigpt.train.budget import EVAL_SLACK, EXIT_SECONDS, STEP_FORWARDS, STOP_EVAL_SECONDS, Budget, lr_at
from minigpt.train.checkpoint import Trainables
from minigpt.train.config import DEFAULT_MAX_ITERS, RATES, RECIPES
from minigpt.train.loop import TrainConfig, TrainState, parse_duration, train
from minigpt.train.muon import Muon
from minigpt.train.reporters import LineReporter, TrainingEnd, TrainingStart, done_text
from minigpt.train.run import make_optimizer
from minigpt.train.step import EVAL_CHUNK, Runtime, eval_chunk_limit, evaluate, split_loss, train_step

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n"
    for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 60)
)
TINY = ["--preset", "tiny", "--batch-size", "4", "--eval-iters", "2", "--log-every", "5"]


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def tiny_cfg(**kw) -> TrainConfig:
    base = dict(
        preset="tiny",
        batch_size=4,
        eval_iters=2,
        eval_every=5,
        log_every=5,
        max_iters=10,
        warmup=2,
        device="cpu",
        dtype="float32",
    )
    model = {k: kw.pop(k) for k in list(kw) if k in nested_names(TrainConfig, "overrides")}
    return TrainConfig(**{**base, **kw}, overrides={"dropout": 0.1, **model})


def data_cfg(path: Path, tmp_path: Path) -> DataConfig:
    return DataConfig(paths=(path,), cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_cli_train_then_eval_then_params(runner, text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            str(text_file),
            *TINY,
            "--max-iters",
            "12",
            "--eval-every",
            "6",
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    for name in (
        RunDir.CONFIG,
        RunDir.TOKENIZER,
        RunDir.WEIGHTS,
        RunDir.STATE,
        RunDir.METRICS,
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / RunDir.CONFIG).read_text())
    assert config["metrics"]["best_val_loss"] > 0 and config["train"]["max_iters"] == 12
    records = RunDir(out).read_metrics()
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12]
    assert "generate with: minigpt generate --model" in result.output

    result = runner.invoke(app, ["eval", str(out), str(text_file), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert (
        metrics["loss"] > 0
        and abs(metrics["perplexity"] - 2.718281828 ** metrics["loss"]) < 1e-3 * metrics["perplexity"]
    )
    assert metrics["bits_per_byte"] > 0

    result = runner.invoke(app, ["params", str(out), "--json"])
    report = json.loads(result.stdout)
    assert report["exact_total"] == report["stored_total"]
    model, _, _ = RunDir(out).load_model()
    assert model.num_params() == report["exact_total"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch",
    [
        dict(arch="gpt2", optimizer="adamw"),
        dict(arch="modern", optimizer="muon", qk_norm=True, n_kv_head=1, window=8, head_lr=3e-3, beta1=0.85),
        dict(
            arch="modern",
            optimizer="muon",
            value_embeds=True,
            skips=True,
            logit_cap=10.0,
            zero_init=True,
            orthogonalizer="polar-express",
            normuon=True,
            batch_ramp=0.5,
            seq_ramp=0.5,
        ),
        dict(arch="gpt2", optimizer="adamw", attn_score="dot"),
        dict(arch="gpt2", optimizer="adamw", attn_score="general"),
        dict(arch="modern", optimizer="muon", n_kv_head=2, window=8, attn_score="additive"),
    ],
    ids=["gpt2", "modern", "speedrun", "dot", "general", "additive"],
)
def test_exact_resume_is_bitwise(text_file: Path, tmp_path: Path, arch: dict[str, Any]) -> None:
    """2N steps straight equal N steps, a stop (as Ctrl-C does it), then a resume to 2N."""
    data = data_cfg(text_file, tmp_path)
    cfg = tiny_cfg(max_iters=12, eval_every=4, **arch)
    straight = train(cfg, data, out=tmp_path / "straight")

    def stop_at_6(step: int) -> None:
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(cfg, data, out=tmp_path / "split", on_step=stop_at_6)
    assert first.interrupted and first.state.step == 6
    # as if the run had logged a step after its last checkpoint and then crashed: the resume retrains it
    RunDir(tmp_path / "split").append_metrics({"kind": "train", "step": 7, "loss": 9.0})
    resumed = train(TrainConfig(), resume=tmp_path / "split")
    train_steps = [r["step"] for r in resumed.metrics if r["kind"] == "train"]
    assert train_steps == [1, 5, 10] and train_steps == [
        r["step"] for r in straight.metrics if r["kind"] == "train"
    ]
    assert resumed.state.step == 12 and not resumed.interrupted
    a, _ = load_tensors(tmp_path / "straight" / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    for key in a:
        if key.startswith(("model/", "optim/")):
            assert torch.equal(a[key], b[key]), key
    assert straight.state.best_val_loss == pytest.approx(resumed.state.best_val_loss)


@pytest.mark.slow
def test_an_evaluation_just_before_the_final_one_is_skipped(text_file: Path, tmp_path: Path) -> None:
    """Every 4 steps of 13 evaluates at 4 and 8 (5 steps from the end: more than half of 4), not at 12 (1
    step from the final evaluation at 13), and says so; the checkpoints and the best weights follow."""
    log = io.StringIO()
    cfg = tiny_cfg(max_iters=13, eval_every=4)
    result = train(cfg, data_cfg(text_file, tmp_path), out=tmp_path / "run", reporter=LineReporter(log))
    assert [r["step"] for r in result.metrics if r["kind"] == "eval"] == [4, 8, 13]
    assert "skipped the evaluation at step 12: the final one is 1 step away" in log.getvalue()
    assert RunDir(tmp_path / "run").read_config()["metrics"]["last"]["step"] == 13
    shorter = train(tiny_cfg(max_iters=14, eval_every=4), data_cfg(text_file, tmp_path), out=tmp_path / "b")
    assert [r["step"] for r in shorter.metrics if r["kind"] == "eval"] == [4, 8, 12, 14]


@pytest.mark.slow
def test_exact_resume_with_muon_is_bitwise(runner, text_file: Path, tmp_path: Path) -> None:
    """`--optimizer muon` is saved in config.json and kept on resume, and Muon's momentum buffers travel in
    the state file: 8 steps straight equal 4, a stop, then a resume to 8."""
    data = data_cfg(text_file, tmp_path)
    cfg = tiny_cfg(max_iters=8, eval_every=4, optimizer="muon")
    train(cfg, data, out=tmp_path / "straight")

    def stop_at_4(step: int) -> None:
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)

    assert train(cfg, data, out=tmp_path / "split", on_step=stop_at_4).interrupted
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "split")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "split" / RunDir.CONFIG).read_text())["train"]["optimizer"] == "muon"
    a, _ = load_tensors(tmp_path / "straight" / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    buffers = [k for k in a if k.endswith("/momentum_buffer")]
    # every block's attention and MLP matrices (4 a block, 5 with SwiGLU's gate), and nothing else
    shapes = expected_shapes(RunDir(tmp_path / "split").model_config())
    assert len(buffers) == sum(".h." in name and len(shape) == 2 for name, shape in shapes.items()) >= 8
    assert all(".h." in k and k.endswith(".weight/momentum_buffer") for k in buffers)
    assert a.keys() == b.keys()
    for key in a:
        if key.startswith(("model/", "optim/")):
            assert torch.equal(a[key], b[key]), key


def test_muon_trains_the_blocks_matrices_and_the_schedule_scales_both_rates() -> None:
    model = tiny_model()
    cfg = TrainConfig(lr=1e-2, optimizer="muon", muon_lr=0.05, head_lr=2e-3).with_recipe("cpu")
    optimizer = make_optimizer(model, cfg)
    adamw, muon = optimizer.parts
    assert isinstance(adamw, AdamW) and isinstance(muon, Muon)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = name.startswith("transformer.h.") and p.dim() == 2
        assert (id(p) in in_muon) == hidden, name
    optimizer.set_lr(5e-3)  # half the peak: every group (decay, no decay, head; Muon) at half its own
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-3, 5e-3, 1e-3, 0.025])


def test_a_state_file_from_another_optimizer_is_refused(text_file: Path, tmp_path: Path) -> None:
    """Moments are checked against the optimizer that owns each parameter: an AdamW moment for a matrix
    Muon trains, or a momentum buffer of the wrong shape, is a clean error before anything is loaded."""
    out = tmp_path / "run"
    train(tiny_cfg(max_iters=2, optimizer="muon"), data_cfg(text_file, tmp_path), out=out)
    tensors, _ = load_tensors(out / RunDir.STATE)
    model = GPT(RunDir(out).model_config())
    cfg = TrainConfig(lr=1e-3, optimizer="muon", muon_lr=0.02).with_recipe("cpu")
    parts = Trainables(model, make_optimizer(model, cfg), None)  # type: ignore[arg-type]
    parts.check(tensors, "state")
    key = next(k for k in tensors if k.endswith("mlp.c_fc.weight/momentum_buffer"))
    for bad, message in (
        (
            {key.replace("momentum_buffer", "exp_avg"): tensors[key]},
            "not one its parameter's optimizer keeps",
        ),
        ({key: tensors[key][:1].clone()}, "does not fit its parameter"),
        ({key: tensors[key].double()}, "does not fit its parameter"),
    ):
        with pytest.raises(MinigptError, match=message):
            parts.check({**tensors, **bad}, "state")


@pytest.mark.slow
def test_resume_can_raise_the_budget(runner, text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert (
        runner.invoke(app, ["train", str(text_file), *TINY, "--max-iters", "4", "--out", str(out)]).exit_code
        == 0
    )
    result = runner.invoke(app, ["train", "--resume", str(out), "--max-iters", "8"])
    assert result.exit_code == 0, result.output
    steps = [r["step"] for r in RunDir(out).read_metrics() if r["kind"] == "eval"]
    assert steps[-1] == 8
    result = runner.invoke(app, ["train", "--resume", str(out), "--lr", "1", "--untie", "--out", "x"])
    assert result.exit_code == 2 and "only budget options" in result.output
    assert "(got --untie, --lr, --out)" in result.output  # in help order
    fine_tune = [
        "train",
        str(text_file),
        "--init-from",
        str(out),
        "--out",
        str(tmp_path / "ft"),
        "--max-iters",
        "1",
    ]
    result = runner.invoke(app, [*fine_tune, "--n-layer", "3", "--arch", "modern"])
    assert (
        result.exit_code == 2
        and "takes the model's shape from that run: drop --arch, --n-layer" in result.output
    )
    assert runner.invoke(app, [*fine_tune, "--dropout", "0.1"]).exit_code == 0  # dropout is a training choice
    assert RunDir(tmp_path / "ft").model_config().dropout == 0.1


@pytest.mark.slow
def test_refuses_to_overwrite(runner, text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", str(text_file), *TINY, "--max-iters", "2", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    before = (out / RunDir.WEIGHTS).read_bytes()
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "--overwrite" in result.output
    assert (out / RunDir.WEIGHTS).read_bytes() == before
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "budget, reason, check",
    [
        (dict(max_iters=3), "max_iters 3", lambda s: s.step == 3),
        (dict(max_tokens=4 * 32 * 5), "max_tokens 640", lambda s: s.step == 5),
        (dict(max_time=2.0), "max_time 2 s", lambda s: s.step >= 1),
        (dict(max_iters=100000, max_tokens=4 * 32 * 2), "max_tokens 256", lambda s: s.step == 2),
    ],
)
def test_budgets_first_reached_stops(
    text_file: Path, tmp_path: Path, budget: dict, reason: str, check
) -> None:
    clock = FakeClock()  # steps of 0.1 s

    def tick(step: int) -> None:
        clock.now += 0.1

    result = train(
        tiny_cfg(**{"max_iters": None, **budget}), data_cfg(text_file, tmp_path), out=tmp_path / "run",
        clock=clock, on_step=tick,
    )  # fmt: skip
    assert result.stop_reason == f"reached {reason}" and check(result.state), result


def test_schedules() -> None:
    cos = TrainConfig(lr=1.0, min_lr=0.1, schedule="cosine")
    assert lr_at(cos, 0, 0.0, 10) == pytest.approx(0.1) and lr_at(cos, 9, 0.0, 10) == pytest.approx(1.0)
    assert lr_at(cos, 50, 0.5, 10) == pytest.approx(0.55) and lr_at(cos, 99, 1.0, 10) == pytest.approx(0.1)
    linear = TrainConfig(lr=1.0, min_lr=0.0, schedule="wsd", cooldown=0.4, cooldown_shape="linear")
    lrs = [lr_at(linear, 50, p, 10) for p in (0.1, 0.6, 0.7, 0.9, 1.0)]
    assert lrs == pytest.approx([1, 1, 0.75, 0.25, 0])
    # the default decay: 1 - sqrt(a quarter, three quarters of the cooldown gone), down to min_lr
    wsd = TrainConfig(lr=1.0, min_lr=0.2, schedule="wsd", cooldown=0.4)
    lrs = [lr_at(wsd, 50, p, 10) for p in (0.1, 0.6, 0.7, 0.9, 1.0)]
    assert lrs == pytest.approx([1, 1, 0.2 + 0.8 * 0.5, 0.2 + 0.8 * (1 - 0.75**0.5), 0.2])
    assert lr_at(wsd, 5, 0.0, 10) == pytest.approx(0.6)  # warmup comes first either way
    assert lr_at(wsd, 0, 0.0, 0) == 1.0  # no warmup


def test_a_run_saved_before_the_decay_had_a_shape_keeps_decaying_linearly() -> None:
    saved = {k: v for k, v in TrainConfig(schedule="wsd").to_dict().items() if k != "cooldown_shape"}
    assert TrainConfig.from_dict(saved).cooldown_shape == "linear"
    assert TrainConfig.from_dict(TrainConfig(schedule="wsd").to_dict()).cooldown_shape == "sqrt"


def test_an_unknown_cooldown_shape_is_refused_in_one_line(runner, text_file: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cooldown_shape"):
        TrainConfig(cooldown_shape="cubic")
    out = tmp_path / "run"
    bad = runner.invoke(app, ["train", str(text_file), "--cooldown-shape", "cubic", "--out", str(out)])
    assert bad.exit_code == 2 and "--cooldown-shape" in bad.output and not out.exists()


def test_warmup_is_capped_at_a_tenth_of_the_budget() -> None:
    assert Budget(max_iters=50).warmup_steps(100, TrainState(), 1000) == 5
    assert Budget(max_iters=5000).warmup_steps(100, TrainState(), 1000) == 100
    assert Budget(max_tokens=30_000).warmup_steps(100, TrainState(), 1000) == 3  # 30 steps of 1000 tokens
    assert Budget(max_iters=50).warmup_steps(0, TrainState(), 1000) == 0
    clock = FakeClock()
    timed = Budget(max_time=100.0, reserve=5.0, clock=clock)
    assert timed.warmup_steps(100, TrainState(), 1000) == 100  # no step timed yet: nothing to cap it by
    timed.observe_step(1.0)  # 10 s in, steps of 1 s: about 84 more fit before the reserve
    assert timed.warmup_steps(100, TrainState(step=2, elapsed=10.0), 1000) == 8


def test_recipes_fill_what_was_left_unset() -> None:
    cpu = TrainConfig().with_recipe("cpu")
    assert (cpu.preset, cpu.schedule, cpu.lr, cpu.min_lr, cpu.head_lr) == ("nano", "wsd", 1.6e-2, 0.0, 4e-3)
    gpu = TrainConfig().with_recipe("cuda")
    assert (gpu.schedule, gpu.min_lr) == ("cosine", pytest.approx(1e-4))
    mine = TrainConfig(lr=1e-3, schedule="cosine", batch_size=7).with_recipe("cpu")
    assert (mine.lr, mine.min_lr, mine.batch_size, mine.preset) == (1e-3, pytest.approx(1e-4), 7, "nano")
    # a run saved before --schedule existed resumes with the cosine it was trained with
    old = {k: v for k, v in cpu.to_dict().items() if k not in ("schedule", "cooldown")}
    assert TrainConfig.from_dict(old).schedule == "cosine"
    for bad in (dict(schedule="linear"), dict(cooldown=0.0), dict(cooldown=1.5)):
        with pytest.raises(MinigptError, match="schedule|cooldown"):
            TrainConfig(**bad)


def test_budget_with_a_fake_clock() -> None:
    clock = FakeClock()
    budget = Budget(max_time=10.0, clock=clock)
    budget.start(started=clock.now - 1.0, elapsed=2.0)  # resumed at 2 s, this command started 1 s ago
    assert budget.elapsed() == pytest.approx(3.0)
    clock.now += 4.0
    state = TrainState(elapsed=budget.elapsed())
    assert state.elapsed == pytest.approx(7.0)
    assert budget.stop_reason(state) is None and budget.progress(state) == pytest.approx(0.7)
    budget.reserve = 2.0  # the schedule ends when training does, before the final evaluation
    assert budget.progress(state) == pytest.approx(7 / 8)
    budget.reserve = 3.0
    assert budget.stop_reason(state) == "reached max_time 10 s" and budget.progress(state) == 1.0
    budget.reserve = 2.0
    budget.observe_step(0.5)  # the next step must fit before the reserve too
    assert budget.progress(state) == pytest.approx(7 / 7.5) and budget.stop_reason(state) is None
    budget.observe_step(1.5)  # a running estimate: 0.5 + 0.1 x (1.5 - 0.5)
    assert budget.step_seconds == pytest.approx(0.6)
    assert budget.overrun(12.0) == pytest.approx(2.0) and budget.overrun(9.0) == 0.0
    steps = Budget(max_iters=10, max_tokens=1000, reserve=3.0)
    assert steps.progress(TrainState(step=5, tokens=100)) == 0.5  # the largest fraction; no time budget
    assert steps.stop_reason(TrainState(step=5, tokens=1000)) == "reached max_tokens 1,000"
    assert steps.describe() == "10 steps or 1,000 tokens" and steps.overrun(1e9) == 0.0
    # a time budget set on a resume counts from where that command began
    later = Budget(max_time=5.0, time_from=100.0)
    assert later.progress(TrainState(elapsed=102.0)) == pytest.approx(0.4)
    assert later.describe() == "5 s of wall time from 1 min 40 s into the run"  # a bare 5 reads as this
    assert later.stop_reason(TrainState(elapsed=105.0)) == "reached max_time 5 s"


@pytest.mark.slow
def test_a_run_stopped_by_a_signal_evaluates_for_a_few_seconds_then_saves(
    text_file: Path, tmp_path: Path
) -> None:
    """Steps of 3 s on a fake clock (a forward pass of a window: 3 / (3 x 4) s, 2 s for a batch of 4 windows
    on each split), then Ctrl-C: the final evaluation takes the batches that fit in STOP_EVAL_SECONDS, not
    the 50 asked for; a run stopped before a step was timed saves without one, and says so."""
    clock, log = FakeClock(), io.StringIO()

    def slow_steps_then_ctrl_c(step: int) -> None:
        clock.now += 3.0
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    cfg = tiny_cfg(eval_iters=50, eval_every=100, max_iters=None, max_tokens=10**9)
    result = train(cfg, data_cfg(text_file, tmp_path), out=tmp_path / "run", clock=clock,
                   on_step=slow_steps_then_ctrl_c, reporter=LineReporter(log))  # fmt: skip
    batch_seconds = 2 * cfg.batch_size * 3.0 / (STEP_FORWARDS * cfg.batch_size)  # both splits
    (final,) = [r for r in result.metrics if r["kind"] == "eval"]
    assert result.interrupted and final["step"] == 3
    assert final["eval_iters"] == int(STOP_EVAL_SECONDS / batch_seconds) == 2
    assert RunDir(result.out).weights_path.is_file()

    def ctrl_c_at_once(step: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    result = train(cfg, data_cfg(text_file, tmp_path), out=tmp_path / "early", clock=clock,
                   on_step=ctrl_c_at_once, reporter=LineReporter(log))  # fmt: skip
    assert result.interrupted and not [r for r in result.metrics if r["kind"] == "eval"]
    assert "stopping: saving step 1 without a final evaluation" in log.getvalue()
    assert RunDir(result.out).weights_path.is_file()


def test_time_budget_counts_from_when_the_command_started(text_file: Path, tmp_path: Path) -> None:
    """The command began 29.8 s before train() was called (start-up, tokenizing): 0.2 s of a 30 s budget
    is left, less than the final evaluation and exit keep back, so no step is taken (steps cost 1 s)."""
    clock = FakeClock()

    def one_second_steps(step: int) -> None:
        clock.now += 1.0

    cfg = tiny_cfg(max_iters=None, max_time=30.0, eval_every=10_000)
    result = train(
        cfg, data_cfg(text_file, tmp_path), out=tmp_path / "run", clock=clock, started=clock.now - 29.8,
        on_step=one_second_steps,
    )  # fmt: skip
    assert result.stop_reason == "reached max_time 30 s" and result.state.step == 0
    assert result.state.elapsed == pytest.approx(29.8)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["wsd", "cosine"])
def test_a_slow_time_budget_still_reaches_the_peak_lr_and_decays_fully(
    text_file: Path, tmp_path: Path, schedule: str
) -> None:
    """Steps of 1 s (a fake clock) under a 60 s budget: about 59 steps, fewer than the 100 warmup steps
    asked for, so warmup is cut to a tenth of them once the first steps are timed."""
    clock = FakeClock()

    def one_second_steps(step: int) -> None:
        clock.now += 1.0

    cfg = tiny_cfg(
        max_iters=None, max_time=60.0, warmup=100, eval_every=10_000, log_every=1, schedule=schedule
    )
    result = train(
        cfg, data_cfg(text_file, tmp_path), out=tmp_path / "run", clock=clock, started=clock.now,
        on_step=one_second_steps,
    )  # fmt: skip
    lrs = [r["lr"] for r in result.metrics if r["kind"] == "train"]
    peak = RECIPES["cpu"]["lr"]
    assert result.stop_reason == "reached max_time 1 min" and 50 <= len(lrs) <= 60
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) < len(lrs) // 10
    final = 0.0 if schedule == "wsd" else peak / 10
    assert lrs[-1] == pytest.approx(final, abs=0.05 * peak)  # within one step of the end of the decay


@pytest.mark.slow
def test_budgets_given_on_resume_replace_the_saved_budget(text_file: Path, tmp_path: Path) -> None:
    out, log, clock = tmp_path / "run", io.StringIO(), FakeClock()

    def half_second_steps(step: int) -> None:
        clock.now += 0.5

    timed = dict(clock=clock, on_step=half_second_steps)
    first = train(
        tiny_cfg(max_iters=4), data_cfg(text_file, tmp_path), out=out, started=clock.now - 1000, **timed
    )
    assert first.state.step == 4 and first.state.elapsed == pytest.approx(1002)  # over 16 minutes
    # a time budget given on resume counts this command's time, not the run's, and replaces max_iters:
    # evaluations take no time on this clock, so 3 s keep back the save and the exit (EXIT_SECONDS and
    # the measured 0.004 s) and the next step (0.5 s): steps go on while those fit
    second = train(TrainConfig(max_time=3.0), resume=out, reporter=LineReporter(log), **timed)
    fit = math.floor((3.0 - EXIT_SECONDS - 0.004) / 0.5)
    assert second.stop_reason == "reached max_time 3 s" and second.state.step == 4 + fit
    assert "budget: 3 s of wall time from 16 min 42 s" in log.getvalue()
    assert "(set on resume, in place of the saved 4 steps)" in log.getvalue()
    saved = json.loads((out / RunDir.CONFIG).read_text())["train"]
    assert (saved["max_iters"], saved["max_time"]) == (None, 3.0)
    # none given: the saved budget stands, still counted from where that resume began: 0.496 s of it are
    # left before the time kept back, and a command's first step, not yet priced, takes them (a fresh 3 s
    # budget would have taken 3)
    third = train(TrainConfig(), resume=out, reporter=LineReporter(log), **timed)
    assert third.stop_reason == "reached max_time 3 s" and third.state.step == second.state.step + 1
    assert "budget: 3 s of wall time from 16 min 42 s" in log.getvalue() and "(as saved)" in log.getvalue()
    # steps given on resume count over the whole run, whatever time budget there was
    fourth = train(TrainConfig(max_iters=second.state.step + 3), resume=out, **timed)
    assert fourth.stop_reason == f"reached max_iters {second.state.step + 3}"


def test_the_time_reserve_is_estimated_before_the_first_evaluation(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed forward pass over a batch of windows (the second of two; 0.1 s a window on a fake clock)
    prices the final evaluation; with its slack, the guess at the save and the exit, that is the time kept
    back."""
    from minigpt.train.distributed import DistContext
    from minigpt.train.reporters import QuietReporter
    from minigpt.train.run import SAVE_BYTES_PER_SECOND, plan_run, set_up

    clock, forward = FakeClock(), GPT.forward

    def slow(self: GPT, idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        clock.now += 0.0 if self.training else 0.1 * idx.size(0)
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", slow)
    plan = plan_run(
        tiny_cfg(max_iters=None, max_time=60.0, eval_iters=3),
        data_cfg(text_file, tmp_path),
        out=tmp_path / "r",
    )
    run = set_up(plan, DistContext(), QuietReporter(), clock=clock)
    assert run.budget.eval_cost.window_seconds == pytest.approx(0.1)
    # 3 batches of 4 windows on each split (the validation split holds fewer)
    windows = sum(min(12, (len(split) - 1) // 32) for split in (run.dataset.val, run.dataset.train))
    save = 16 * run.parts.model.num_params() / SAVE_BYTES_PER_SECOND
    assert run.budget.reserve == pytest.approx((1 + EVAL_SLACK) * 0.1 * windows + save + EXIT_SECONDS)


@pytest.mark.parametrize(
    "text, seconds", [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "10x", "-5s", "0"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(MinigptError):
        parse_duration(text)


def _default_values(label: str) -> dict[str, str]:
    """'cpu: 8e-3, gpu: 1e-3' -> {'cpu': '8e-3', 'gpu': '1e-3'}; '100' -> {'': '100'}."""
    parts = [part.split(": ") if ": " in part else ["", part] for part in label.split(", ")]
    return {key: value for key, value in parts}


def _same(text: str, value: object) -> bool:
    if isinstance(value, bool):
        return text in ("bias", "compile", "tie") if value else text in ("untie",) or text.startswith("no-")
    try:
        return float(text) == float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return text == str(value)


def test_train_help_shows_every_default_as_the_config_has_it(runner) -> None:
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"})
    shown = " ".join(result.output.replace("│", " ").split())
    defaults = TrainConfig()
    for option in options_of(TrainConfig):
        if option.name in ("max_time", "max_tokens"):  # no default
            continue
        label = option.label()
        assert label is not None and f"[default: {label}]" in shown, option.name
        values = _default_values(label)
        if option.name in RECIPES["cpu"]:
            # by device, and for the rates by LoRA and the data's kind where they set them
            by = RATES if option.setting.by is RATES else RECIPES
            cases = {case: rates for case, rates in by.items() if option.name in rates}
            assert values.keys() == cases.keys(), option.name
            assert all(_same(values[d], cases[d][option.name]) for d in cases), option.name
        elif option.into is None and getattr(defaults, option.name) is not None:
            assert _same(values[""], getattr(defaults, option.name)), option.name
        elif option.name in ARCHS["gpt2"]:
            assert values.keys() == ARCHS.keys(), option.name
            assert all(_same(values[a], ARCHS[a][option.name]) for a in ARCHS), option.name
    assert "[default: cosine: lr/10, wsd: 0]" in shown
    # --head-lr, as with_recipe fills it (preference pairs and tasks keep the device's share)
    assert "[default: cpu: lr*0.25, gpu: lr, LoRA on cpu: lr, LoRA on pairs or tasks: lr]" in shown
    lr = "cpu: 0.016, gpu: 1e-3, LoRA on cpu: 8e-3, preference pairs: 1e-4, tasks: 3e-4, LoRA on pairs or tasks: 1e-3"
    assert f"[default: {lr}]" in shown
    assert "[default: cpu: muon, gpu: adamw, preference pairs: adamw, tasks: adamw" in shown  # --optimizer
    assert (
        TrainConfig(lr=1.0).with_recipe("cuda").min_lr == 0.1
        and TrainConfig(lr=1.0).with_recipe("cpu").min_lr == 0
    )
    assert f"[default: {DEFAULT_MAX_ITERS} when no budget is given]" in shown
    assert f"Model shape preset: {', '.join(PRESETS)}." in shown and "nano" in PRESETS


def training_start(start: TrainState, progress: float = 0.0, elapsed: float = 0.0) -> TrainingStart:
    return TrainingStart(
        out=Path("checkpoints/some-rather-long-run-name"), model=GPTConfig(vocab_size=65, n_layer=2, n_embd=128,
        n_head=4, block_size=64), n_params=413_312, tokenizer="char (65 symbols)", train_tokens=1_003_855,
        val_tokens=111_539, device="cpu", dtype="float32", world_size=1, batch_size=16, grad_accum=1,
        budget="5 min of wall time from 10 min into the run (set on resume, in place of the saved 2,000 steps)",
        start=start, start_progress=progress, elapsed=elapsed,
    )  # fmt: skip


def display_lines(display: TrainingDisplay) -> list[str]:
    console = Console(width=80, file=io.StringIO(), color_system=None)
    with console.capture() as captured:
        console.print(display.render())
    return captured.get().splitlines()


def test_display_shows_dashes_until_there_are_values_and_fits_80_columns() -> None:
    clock = FakeClock()
    display = TrainingDisplay(console=Console(file=io.StringIO()), live=False, clock=clock)
    display.start(training_start(TrainState(), elapsed=2.0))
    lines = display_lines(display)
    assert all(len(line) <= 80 for line in lines) and "nan" not in "".join(lines)
    assert "step loss —" in lines[2] and "— tok/s" in lines[2]
    assert "val loss —  train loss —  best val —" in lines[3]
    assert lines[1].startswith("elapsed 0:02  ETA —")
    clock.now += 1.0  # no step yet: the clock figures move on each redraw anyway
    assert display_lines(display)[1].startswith("elapsed 0:03")


def test_display_after_a_resume_carries_the_best_loss_and_counts_its_own_rate() -> None:
    clock = FakeClock()
    display = TrainingDisplay(console=Console(file=io.StringIO()), live=False, clock=clock)
    resumed = TrainState(step=1000, tokens=1_024_000, elapsed=600.0, best_val_loss=1.5, best_step=1000,
                         last_eval={"val_loss": 1.5, "train_loss": 1.4})  # fmt: skip
    display.start(training_start(resumed, progress=0.5, elapsed=602.0))
    assert "best val 1.5000 at step 1,000" in display_lines(display)[3]
    clock.now += 2.0
    display.step({"step": 1010, "tokens": 1_034_240, "elapsed": 604.0, "loss": 1.45, "lr": 1e-3}, 0.51)
    lines = display_lines(display)
    assert "5,120 tok/s" in lines[2]  # 10,240 tokens in 2 s, not the run's 1 million since step 0
    assert lines[1].startswith("elapsed 10:04  ETA 1:38")  # 49% of the budget left, at 1% per 2 s
    clock.now += 96.0
    end = TrainingEnd(out=Path("run"), state=resumed, reason="reached max_iters 2,000", interrupted=False,
                      elapsed=700.0, command_seconds=100.0, overrun=0.0, best_val_bpb=2.1, history=[])  # fmt: skip
    assert display_lines(display)[1].startswith("elapsed 11:40")
    assert "2,000 after 1,000 steps, 1,024,000 tokens, 11:40 (1:40 in this command)" in done_text(end)


@pytest.mark.parametrize("kind", ["lines", "panel"])
def test_the_rate_after_an_evaluation_counts_only_the_steps_since(kind: str) -> None:
    """The first rate after an evaluation is its steps' tokens over their own time, not over the
    evaluation's and its save's as well (a log read 9,000 tok/s where the steps ran 50,000)."""
    clock, log = FakeClock(), io.StringIO()
    display = (
        LineReporter(log, clock)
        if kind == "lines"
        else TrainingDisplay(console=Console(file=log, width=80), live=False, clock=clock)
    )
    display.start(training_start(TrainState()))
    clock.now += 1.0
    display.step({"step": 10, "tokens": 20_480, "elapsed": 1.0, "loss": 2.0, "lr": 1e-3}, 0.1)
    clock.now += 4.0  # the evaluation and its save
    record = {"step": 10, "val_loss": 1.9, "train_loss": 1.8, "val_bpb": 2.7, "val_ppl": 6.7}
    display.evaluated(record, improved=True)
    clock.now += 0.5
    display.step({"step": 20, "tokens": 40_960, "elapsed": 5.5, "loss": 1.9, "lr": 1e-3}, 0.2)
    shown = log.getvalue().splitlines()[-1] if kind == "lines" else display_lines(display)[2]
    assert "40,960 tok/s" in shown  # 20,480 tokens in 0.5 s (with the evaluation's 4 s: 4,551)


def test_the_live_display_redraws_with_the_clock_between_steps() -> None:
    """rich's timer refreshes the live display 4 times a second; each refresh renders the clock's time, so
    elapsed moves with no step taken (the refreshes are made by hand here, on a fake clock)."""
    clock, out = FakeClock(), io.StringIO()
    display = TrainingDisplay(
        console=Console(file=out, force_terminal=True, width=80), live=True, clock=clock
    )
    display.start(training_start(TrainState()))
    live = display._live
    assert live is not None and live.auto_refresh and live.refresh_per_second == 4
    for _ in range(3):
        clock.now += 1.0
        live.refresh()  # what the timer does
    display.finish(
        TrainingEnd(Path("run"), TrainState(), "reached max_iters 1", False, 1.0, 1.0, 0.0, 2.0, [])
    )
    assert all(f"elapsed 0:0{s}" in out.getvalue() for s in (1, 2, 3))


class PoisonedSampler(BatchSampler):
    """Batches 6 on have only targets the loss ignores (-1), so their mean loss is 0/0: NaN."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().next_batch()
        return x, (y if self.batches <= 5 else torch.full_like(y, -1))


@pytest.mark.slow
def test_nan_loss_stops_cleanly_and_keeps_last_checkpoint(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(MinigptError, match="loss became nan at step 5"):
        train(
            tiny_cfg(max_iters=10, eval_every=4),
            data_cfg(text_file, tmp_path),
            out=out,
            make_sampler=PoisonedSampler,
        )
    _, meta = load_tensors(out / RunDir.STATE)
    assert json.loads(meta["state"])["step"] == 4
    model, _, _ = RunDir(out).load_model()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def tiny_model(vocab_size: int = 40) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16))


def test_train_step_takes_one_step_and_a_nan_leaves_the_weights() -> None:
    model, tokens = tiny_model(), np.arange(2000) % 37
    cpu = Runtime(torch.device("cpu"), torch.float32)
    cfg = TrainConfig(lr=1e-2, min_lr=0.0, weight_decay=0.0).with_recipe("cpu")
    sampler = BatchSampler(tokens, 16, 4, seed=1)
    x, y = BatchSampler(tokens, 16, 4, seed=1).next_batch()
    with torch.no_grad():
        expected = model(x, y)[1].item()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, cfg)
    loss = train_step(model, optimizer, sampler, cpu, lr=1e-2, grad_accum=1, grad_clip=1.0)
    assert loss == pytest.approx(expected, rel=1e-5) and sampler.batches == 1
    assert optimizer.param_groups[0]["lr"] == 1e-2
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    # two micro-batches average their losses and draw two batches
    assert math.isfinite(train_step(model, optimizer, sampler, cpu, lr=1e-2, grad_accum=2))
    assert sampler.batches == 3
    poisoned = PoisonedSampler(tokens, 16, 4, seed=1)
    poisoned.batches = 10
    kept = [p.detach().clone() for p in model.parameters()]
    assert math.isnan(train_step(model, optimizer, poisoned, cpu, lr=1e-2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_scores_the_same_fixed_windows_each_time(text_file: Path, tmp_path: Path) -> None:
    dataset = prepare_data(data_cfg(text_file, tmp_path), 16, progress=False)
    model = tiny_model(dataset.tokenizer.vocab_size)
    model.train()
    cpu = Runtime(torch.device("cpu"), torch.float32)
    first = evaluate(model, model.config, dataset, 4, 3, cpu)
    assert first == evaluate(model, model.config, dataset, 4, 3, cpu) and model.training
    assert first["val_ppl"] == pytest.approx(math.exp(first["val_loss"]))
    assert first["val_bpb"] == pytest.approx(
        first["val_loss"] / math.log(2) * len(dataset.val) / dataset.val_bytes
    )
    # 3 batches of 4 windows: the mean loss of those 12 back-to-back windows, evenly spaced over the split
    windows = (len(dataset.val) - 1) // 16
    starts = np.unique(np.linspace(0, windows - 1, 12).round().astype(int)) * 16
    x = torch.tensor(np.stack([dataset.val[s : s + 16] for s in starts]).astype(np.int64))
    y = torch.tensor(np.stack([dataset.val[s + 1 : s + 17] for s in starts]).astype(np.int64))
    model.eval()
    with torch.no_grad():
        assert first["val_loss"] == pytest.approx(model(x, y)[1].item(), rel=1e-5)
    assert split_loss(model, model.config, dataset.val, 4, 3, cpu) == pytest.approx(first["val_loss"])
    # the train loss is measured the same way, on as many fixed windows of the training split
    assert first["train_loss"] == pytest.approx(split_loss(model, model.config, dataset.train, 4, 3, cpu))


def test_an_evaluation_reads_the_same_windows_whatever_its_passes_take() -> None:
    """The passes' size changes how many windows one forward pass takes, not which are read or their mean
    loss: the batch size on the CPU, the most on a GPU, a given size within that limit."""
    model = tiny_model(32)
    tokens = torch.randint(
        0, 32, (40 * model.config.block_size + 1,), generator=torch.Generator().manual_seed(0)
    )
    losses, passes = {}, []
    model.register_forward_pre_hook(lambda module, args: passes.append(len(args[0])))
    for chunk, expected in ((0, [4] * 9), (12, [12] * 3), (5, [5] * 7 + [1]), (1000, [36])):
        passes.clear()
        runtime = Runtime(torch.device("cpu"), torch.float32, eval_chunk=chunk)
        losses[chunk] = split_loss(model, model.config, tokens.numpy(), 4, 9, runtime)  # 9 batches of 4
        assert passes == expected, chunk
    # float32 losses, one mean a pass, summed in float64: equal to float32's rounding
    assert all(loss == pytest.approx(losses[0], rel=1e-6) for loss in losses.values())
    gpu = Runtime(torch.device("cuda"), torch.float32)
    assert step._chunk(model.config, 4, gpu) == eval_chunk_limit(model.config, 4) == EVAL_CHUNK


def test_eval_chunk_is_a_positive_count_and_reaches_the_run(runner, text_file: Path, tmp_path: Path) -> None:
    args = ["train", str(text_file), "--preset", "tiny", "--max-iters", "1", "--eval-iters", "1", "--tokenizer",
            "char", "--device", "cpu", "--out", str(tmp_path / "run")]  # fmt: skip
    bad = runner.invoke(app, [*args, "--eval-chunk", "0"])
    assert bad.exit_code == 2 and "--eval-chunk" in bad.output and not (tmp_path / "run").exists()
    with pytest.raises(UsageError, match="eval_chunk must be at least 1"):
        TrainConfig(eval_chunk=0)
    result = runner.invoke(app, [*args, "--eval-chunk", "3"])
    assert result.exit_code == 0, result.output
    assert RunDir(tmp_path / "run").read_config()["train"]["eval_chunk"] == 3


@pytest.mark.slow
def test_the_library_is_quiet_and_needs_no_rich(text_file: Path, tmp_path: Path, capsys) -> None:
    train(tiny_cfg(max_iters=2), data_cfg(text_file, tmp_path), out=tmp_path / "quiet")
    assert capsys.readouterr() == ("", "")
    train(
        tiny_cfg(max_iters=2), data_cfg(text_file, tmp_path), out=tmp_path / "lines", reporter=LineReporter()
    )
    err = capsys.readouterr().err
    assert "step      1 | loss" in err and "done: reached max_iters 2" in err
    code = "import sys, minigpt.train.loop; sys.exit('rich' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_a_resume_keeps_the_saved_settings(text_file: Path, tmp_path: Path) -> None:
    train(tiny_cfg(max_iters=2), data_cfg(text_file, tmp_path), out=tmp_path / "run")
    with pytest.raises(UsageError, match="only the budget may change .got lr, out"):
        train(TrainConfig(lr=1.0), resume=tmp_path / "run", out=tmp_path / "elsewhere")


@pytest.mark.slow
def test_non_tty_log_lines(text_file: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "minigpt",
            "train",
            str(text_file),
            *TINY,
            "--max-iters",
            "10",
            "--eval-every",
            "5",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MINIGPT_CACHE_DIR": str(tmp_path / "c")},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert any(line.startswith("step ") and "| loss " in line and "tok/s" in line for line in lines), (
        out.stderr
    )
    assert any(line.startswith("eval ") and "val loss" in line and "val bpb" in line for line in lines)


@pytest.mark.slow
def test_sigint_saves_and_says_how_to_resume(text_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minigpt",
            "train",
            str(text_file),
            *TINY,
            "--max-iters",
            "1000000",
            "--eval-every",
            "100000",
            "--out",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MINIGPT_CACHE_DIR": str(tmp_path / "c")},
    )
    assert proc.stderr is not None
    seen = []  # wait for the first logged step: training is under way (no timer, however slow the machine)
    while not (seen and seen[-1].startswith("step ")):
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)  # the process ended first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert f"resume with: minigpt train --resume {run}" in err
    model, _, _ = RunDir(run).load_model()
    assert model.num_params() > 0


SAVER = """
import os, signal, sys, torch
from pathlib import Path
import safetensors.torch
from minigpt.model.config import ARCHS, GPTConfig
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer
from minigpt.model.build import model_tensors

# kill -9 at the KILL_AT-th event: each half of every file written (so in the middle of a write), and each
# rename (after the temp file was written and synced, before it lands)
KILL_AT, events = int(sys.argv[3]), 0

def event():
    global events
    events += 1
    if events == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)

def write_halves(path, data):
    with open(path, "wb") as f:
        for half in (data[: len(data) // 2], data[len(data) // 2 :]):
            f.write(half)
            f.flush()
            event()
    return len(data)

def replace(src, dst, replace=os.replace):
    event()
    replace(src, dst)

safetensors.torch.save_file = lambda tensors, path, metadata=None: write_halves(
    path, safetensors.torch.save(tensors, metadata=metadata)
)
Path.write_bytes = write_halves
os.replace = replace
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=4, n_head=4, n_embd=128))
tok = CharTokenizer([chr(65 + i) for i in range(40)])
run = RunDir(Path(sys.argv[1]))
i = int(sys.argv[2])
while True:
    with torch.no_grad():
        model.transformer.wte.weight.fill_(float(i))
    run.save(model, tok, {"metrics": {"best_step": i}}, weights_metadata={"step": str(i)})
    run.save_state(model_tensors(model), {"step": str(i)})
    i += 1
"""


def check_one_whole_save(run: Path) -> int:
    """The run loads; its weights, config.json and state each come whole from one save, and the weights and
    the config.json describing them from the same one. Returns that save's number."""
    model, _, config = RunDir(run).load_model()
    fill = model.transformer.wte.weight
    step = int(fill.flatten()[0].item())
    assert torch.all(fill == step)  # never a mix of two saves
    _, meta = load_tensors(run / RunDir.WEIGHTS)
    assert int(meta["step"]) == step
    if config["metrics"]["best_step"] != step:
        # only a kill between the two renames that land a save (microseconds apart) leaves config.json a
        # save behind, and then its successor is whole beside it, written before the renames began
        pending = [json.loads(t.read_text()) for t in run.glob(f".{RunDir.CONFIG}.*.tmp")]
        assert [c["metrics"]["best_step"] for c in pending] == [step], (config["metrics"], step)
    if (run / RunDir.STATE).exists():  # saved after the weights, so it may be a save behind
        tensors, meta = RunDir(run).load_state()
        assert torch.all(tensors["transformer.wte.weight"] == int(meta["step"])) and int(meta["step"]) <= step
    return step


@pytest.mark.slow
def test_save_killed_at_random_points_leaves_loadable_checkpoint(tmp_path: Path) -> None:
    """Eight writers, each killed with SIGKILL at a random point of its saves (a half-written file, a
    synced temp file not yet renamed, between two renames) chosen from a seeded generator, so the same
    points on every machine and at every load; after each, the run holds one whole save."""
    run = tmp_path / "run"
    rng = random.Random(0)
    saves = []
    for first in range(0, 8000, 1000):
        kill_at = rng.randint(1, 48)  # a save is 12 events: about 4 saves deep
        proc = subprocess.run([sys.executable, "-c", SAVER, str(run), str(first), str(kill_at)], cwd=ROOT)
        assert proc.returncode == -signal.SIGKILL
        if (run / RunDir.WEIGHTS).exists():
            saves.append(check_one_whole_save(run))
    assert len(saves) >= 4, saves  # most kills came after a whole save, so the checks above ran


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: (d / "empty.txt").write_text("   \n") and d / "empty.txt", "empty"),
        (lambda d: (d / "bin.txt").write_bytes(bytes(range(256)) * 4) and d / "bin.txt", "binary"),
        (
            lambda d: (
                (d / "bad.txt").write_bytes(b"hello " * 100 + b"\xff\xfe" + b"x" * 100) and d / "bad.txt"
            ),
            "UTF-8",
        ),
        (lambda d: (d / "short.txt").write_text("just a few words") and d / "short.txt", "block"),
        (lambda d: (d / "emptydir").mkdir() or d / "emptydir", ".txt"),
    ],
)
def test_bad_input_through_train(runner, tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    result = runner.invoke(
        app, ["train", str(path), *TINY, "--max-iters", "2", "--out", str(tmp_path / "run")]
    )
    assert result.exit_code in (1, 2), result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message.lower() in errors[0].lower(), result.output
    assert result.output.strip().splitlines()[-1] == errors[0] and "Traceback" not in result.output
    assert not (tmp_path / "run" / RunDir.WEIGHTS).exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "0"], "batch_size must be a positive integer"),
        (["--lr", "-1"], "lr"),
        (["--max-time", "soon"], "duration"),
        (["--n-embd", "30", "--n-head", "4"], "divisible"),
        (["--n-embd", "128", "--n-head", "3"], "try n_head 2 or 4, or n_embd 120 or 144"),
        (["--dropout", "1.5"], "dropout"),
        (["--tokenizer", "nonsense"], "tokenizer"),
        (["--device", "tpu"], "device"),
        (["--dtype", "int8"], "dtype"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], "256"),
        (["--cooldown", "0"], "cooldown is a fraction"),
        (["--cooldown", "1.5"], "cooldown is a fraction"),
    ],
)
def test_bad_options_through_train(
    runner, text_file: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    result = runner.invoke(
        app, ["train", str(text_file), *TINY, "--max-iters", "2", "--out", str(tmp_path / "r"), *args]
    )
    assert result.exit_code in (1, 2), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output


@pytest.mark.slow
def test_resume_finds_moved_text_and_refuses_changed_text(runner, text_file: Path, tmp_path: Path) -> None:
    """config.json records each input's absolute path and stamp (size, mtime, sampled content): a run resumes
    from another folder, with the text at a new place when it moved, and refuses text that changed unless
    --allow-data-change."""
    out = tmp_path / "run"
    args = ["train", str(text_file), *TINY, "--max-iters", "2", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    (record,) = json.loads((out / RunDir.CONFIG).read_text())["data"]["inputs"]
    assert record["path"] == str(text_file.resolve()) and len(record["fingerprint"]) == 64
    moved = tmp_path / "elsewhere" / "moved.txt"
    moved.parent.mkdir()
    text_file.rename(moved)
    result = runner.invoke(app, ["train", "--resume", str(out), "--max-iters", "3"])
    assert result.exit_code == 1 and "is not there: give its new place" in result.stderr
    result = runner.invoke(app, ["train", "--resume", str(out), str(moved), "--max-iters", "3"])
    assert result.exit_code == 0, result.output
    moved.write_text(TEXT[::-1], encoding="utf-8")
    result = runner.invoke(app, ["train", "--resume", str(out), str(moved), "--max-iters", "4"])
    assert result.exit_code == 1 and "the text differs from what" in result.stderr
    assert (
        "(changed: moved.txt)" in result.stderr
        or "changed or missing: tiny.txt; new: moved.txt" in result.stderr
    )
    args = ["train", "--resume", str(out), str(moved), "--max-iters", "4", "--allow-data-change"]
    assert runner.invoke(app, args).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("given", ["tiny.txt", "./tiny.txt", "sub/../tiny.txt", "{work}/tiny.txt"])
def test_resume_from_another_folder_whatever_form_the_path_had(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """`train` given the text by a relative (or absolute) path in one folder, `--resume` from another folder,
    the run named by an absolute and then by a relative path: config.json's absolute paths find the text."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (work / "tiny.txt").write_text(TEXT, encoding="utf-8")
    monkeypatch.chdir(work)
    args = ["train", given.format(work=work), *TINY, "--max-iters", "2", "--out", "checkpoints/tiny"]
    assert runner.invoke(app, args).exit_code == 0
    monkeypatch.chdir(elsewhere)
    result = runner.invoke(app, ["train", "--resume", str(work / "checkpoints/tiny"), "--max-iters", "3"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["train", "--resume", "../work/checkpoints/tiny", "--max-iters", "4"])
    assert result.exit_code == 0, result.output
    config = json.loads((work / "checkpoints/tiny" / RunDir.CONFIG).read_text())
    assert config["metrics"]["last"]["step"] == 4
    assert config["data"]["paths"] == [str(work / given.format(work=work))]


@pytest.mark.slow
def test_a_run_that_saved_relative_paths_resumes_from_another_folder(
    runner, text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs saved before the paths were made absolute hold them as given; the absolute path recorded for
    each input file stands in for them (and the text is still checked by content)."""
    out = tmp_path / "run"
    args = ["train", str(text_file), *TINY, "--max-iters", "2", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    config = json.loads((out / RunDir.CONFIG).read_text())
    config["data"]["paths"] = [text_file.name]  # as a command run in text_file's folder saved it
    (out / RunDir.CONFIG).write_text(json.dumps(config))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = runner.invoke(app, ["train", "--resume", str(out), "--max-iters", "3"])
    assert result.exit_code == 0, result.output
    (tmp_path / "elsewhere" / text_file.name).write_text(TEXT[::-1], encoding="utf-8")  # a namesake here
    result = runner.invoke(app, ["train", "--resume", str(out), "--max-iters", "4"])
    assert result.exit_code == 0, result.output  # the recorded file, not the namesake


def test_a_batch_past_the_machine_is_refused_before_allocating(
    runner, text_file: Path, tmp_path: Path
) -> None:
    args = [
        "train",
        str(text_file),
        *TINY,
        "--batch-size",
        str(10**9),
        "--max-iters",
        "1",
        "--out",
        str(tmp_path / "r"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "training with batch_size 1,000,000,000 needs about" in result.stderr
