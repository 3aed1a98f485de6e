"""The CPU recipe and its levers: whole `minigpt train` commands on tinyshakespeare, at equal wall time and at
equal steps.

Each row is what a user waits for: `minigpt train tinyshakespeare.txt --tokenizer char` plus the row's flags,
timed from launch to exit (tokenizing, model build, compiling, every eval and save included), scored by the
validation loss the command itself reports (its last eval, over the held-out last 10%). A time budget
(`--budget 75s,35s`: `--max-time`) measures quality per second and needs a quiet machine; a step budget
(`--steps 300`: `--max-iters`) measures quality per step, which the machine's speed and load do not change,
and each run's median time per step (from its metrics, the first fifth of the steps left out) gives the
row's cost per step relative to the first row measured beside it. Rows run interleaved (seed 1 of every row,
then seed 2, ...) so a change in the load spreads over all of them; `--jobs 2` runs a row's seeds side by
side (step budgets only: a time budget wants the machine to itself). Every timed run starts from the
choices `minigpt train` measures on a machine's first run (its dtype, Muon's, OpenMP's spin), made once per
row by a short run before the timed ones and printed, as any run after a machine's first does. It prints
the README's tables.

    python bench/bench_recipe.py --budget 75s,32s --rows "the default" --seeds 3   # issue 59: 1.50 in 80 s, 1.62 in 35 s
    python bench/bench_recipe.py --steps 300 --jobs 2                      # every lever at equal steps, under load
    python bench/bench_recipe.py --budget 75s --rows "the default" --tokenizer bpe
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

# the CPU default before issue 28, every setting pinned: nano (2 layers, 4 heads, 128 wide, block 64), batch
# 16, lr 8e-3, wsd, --arch modern, Muon at 0.02 with torch.optim.Muon's arithmetic (bf16 iterations),
# attention in float32, evaluation in passes of 256 windows, a linear decay
BEFORE = (
    "--preset nano --block-size 64 --arch modern --optimizer muon --batch-size 16 --lr 8e-3 --schedule wsd "
    "--muon-lr 0.02 --muon-dtype bfloat16 --grad-clip 1 --attention-dtype float32 --eval-chunk 256 "
    "--cooldown-shape linear"
).split()
# each lever row is the default plus one change: its flags, and the same change to TrainConfig (for --step-cost)
LEVERS: dict[str, tuple[str, dict[str, Any]]] = {
    "attention in float32 (before it was measured)": (
        "--attention-dtype float32",
        dict(attention_dtype="float32"),
    ),
    "evaluation in passes of 256 windows (the rule before)": (
        "--eval-chunk 256",
        dict(eval_chunk=256),
    ),
    "a linear decay (the default before)": ("--cooldown-shape linear", dict(cooldown_shape="linear")),
    "clipping at 1 (the default before)": ("--grad-clip 1", dict(grad_clip=1.0)),
    "+ value embeds": ("--value-embeds", dict(overrides=dict(value_embeds=True))),
    "+ skips": ("--skips", dict(overrides=dict(skips=True))),
    "+ zero-init": ("--zero-init", dict(zero_init=True)),
    "+ logit cap 15": ("--logit-cap 15", dict(overrides=dict(logit_cap=15.0))),
    "+ polar-express": ("--orthogonalizer polar-express", dict(orthogonalizer="polar-express")),
    "+ normuon": ("--normuon", dict(normuon=True)),
    "+ muon lr 0.03": ("--muon-lr 0.03", dict(muon_lr=0.03)),
    "muon lr 0.02 (the default before round 3)": ("--muon-lr 0.02", dict(muon_lr=0.02)),
    "+ batch ramp 0.3": ("--batch-ramp 0.3", dict(batch_ramp=0.3)),
    "+ compile": ("--compile", dict(compile=True)),
    "block 64 (the default block before round 3)": ("--block-size 64", dict(overrides=dict(block_size=64))),
    "+ seq ramp 0.8": ("--seq-ramp 0.8", dict(seq_ramp=0.8)),
    # CPUs with bf16 instructions (AVX-512 BF16, AMX): bf16 autocast at nano's width, or a wider model in it
    "+ bf16 autocast": ("--dtype bfloat16", dict(dtype="bfloat16")),
    "width 192, 6 heads, bf16": (
        "--n-embd 192 --n-head 6 --dtype bfloat16",
        dict(overrides=dict(n_embd=192, n_head=6), dtype="bfloat16"),
    ),
    "width 256, 8 heads, bf16": (
        "--n-embd 256 --n-head 8 --dtype bfloat16",
        dict(overrides=dict(n_embd=256, n_head=8), dtype="bfloat16"),
    ),
}
ROWS: dict[str, list[str]] = {
    "the default": [],
    **{name: flags.split() for name, (flags, _) in LEVERS.items()},
    "the recipe before (Muon in bf16)": BEFORE,
}
Result = dict[str, float]


TUNING = Path(tempfile.gettempdir()) / f"minigpt-bench-recipe-{os.getpid()}" / "tuning.json"


def measure_once(rows: dict[str, list[str]], tokenizer: str) -> None:
    """What `minigpt train` measures on a machine's first run (its dtype, Muon's and OpenMP's spin), made
    once per row into TUNING, which every timed run then starts from, as a user's later runs do; each row's
    choice is printed. It measures however busy the machine is (a load average still high from an earlier
    benchmark would otherwise leave every timed run on the fallback): start this on a quiet machine."""
    atexit.register(shutil.rmtree, TUNING.parent, True)
    for row, flags in rows.items():
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--out", str(TUNING.parent / "run"),
               "--overwrite", "--tokenizer", tokenizer, "--max-iters", "2", "--eval-iters", "1", *flags]  # fmt: skip
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(TUNING.parent), "MINIGPT_MEASURE": "on"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        said = json.loads((TUNING.parent / "run" / "config.json").read_text()).get("machine", {})
        print(f"{row}: {said.get('summary', 'no choices measured')}", file=sys.stderr)


def run(flags: list[str], budget: list[str], seed: int, tokenizer: str) -> Result:
    """One whole `minigpt train` command: its wall time, steps, the last validation loss it reports and its
    median seconds per step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--out", str(out), "--log-every"]
        cmd += ["10", "--tokenizer", tokenizer, *budget, "--seed", str(seed), *flags]
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache")}
        if TUNING.is_file():  # the machine's measured choices, as on any run after its first
            (Path(tmp) / "cache").mkdir()
            shutil.copy(TUNING, Path(tmp) / "cache" / "tuning.json")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "eval"][-1]
    return dict(
        wall=wall,
        steps=last["step"],
        loss=last["val_loss"],
        bpb=last["val_bpb"],
        step_s=step_seconds(records),
    )


def step_seconds(records: list[dict[str, float]]) -> float:
    """The median seconds per step between logged training steps, past the first fifth of the run (warmup,
    compilation) and leaving out intervals an evaluation fell into."""
    evals = {r["step"] for r in records if r["kind"] == "eval"}
    train = [r for r in records if r["kind"] == "train"]
    skip = train[-1]["step"] / 5 if train else 0
    rates = [
        (b["elapsed"] - a["elapsed"]) / (b["step"] - a["step"])
        for a, b in zip(train, train[1:], strict=False)
        if a["step"] >= skip and not any(a["step"] <= e < b["step"] for e in evals)
    ]
    return statistics.median(rates) if rates else float("nan")


def step_costs(rows: list[str], rounds: int, steps: int = 3) -> dict[str, tuple[float, float]]:
    """Seconds per training step of the default and of each lever row, in this process: every model built
    and stepped once (its first step, compilation included, timed apart), then `rounds` rounds of `steps`
    steps each, the rows alternating within a round, so load changes fall on all of them alike; each row's
    median. A step is a real one (forward, backward, clipping, both optimizers) on random char tokens; a
    batch ramp's steps cost what its batches do, so its row times full batches."""
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.model.init import zero_output_projections
    from minigpt.train.config import TrainConfig
    from minigpt.train.optimizers import make_optimizer

    def setup(changes: dict[str, Any]) -> Callable[[], None]:
        cfg = TrainConfig(**changes).with_recipe("cpu")
        assert cfg.batch_size is not None and cfg.lr is not None
        model = GPT(cfg.model_config(65))
        if cfg.zero_init:
            zero_output_projections(model)
        optimizer = make_optimizer(model, cfg)
        optimizer.set_lr(cfg.lr)
        forward = torch.compile(model) if cfg.compile else model
        shape = (cfg.batch_size, model.config.block_size)

        def step() -> None:
            x, y = torch.randint(0, 65, shape), torch.randint(0, 65, shape)
            _, loss = forward(x, y)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    torch.manual_seed(0)
    changes = {row: ({} if row == "the default" else LEVERS[row][1]) for row in rows}
    stepping = {row: setup(change) for row, change in changes.items()}
    first: dict[str, float] = {}
    for row, step in stepping.items():
        started = time.perf_counter()
        step()
        first[row] = time.perf_counter() - started
    times: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(rounds):
        for row, step in stepping.items():
            started = time.perf_counter()
            for _ in range(steps):
                step()
            times[row].append((time.perf_counter() - started) / steps)
    return {row: (statistics.median(times[row]), first[row]) for row in rows}


def cost_table(costs: dict[str, tuple[float, float]]) -> list[str]:
    base = costs["the default"][0]
    lines = [
        "| row | time per step | vs the default | first step (compiling included) |",
        "|---|---:|---:|---:|",
    ]
    for row, (median, first) in costs.items():
        lines.append(f"| {row} | {median * 1e3:.1f} ms | {median / base:.2f}x | {first:.1f} s |")
    return lines


def table(rows: list[str], results: dict[str, list[Result]], base: str, timed: bool) -> list[str]:
    """One budget's table: each row's loss per seed, its mean and difference from `base`, and its cost."""
    lines = [
        "| row | val loss per seed | mean | vs first row | bits per byte | steps | time per step | wall s |"
    ]
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
    ref = results[base]
    for row in rows:
        runs = results[row]
        mean = statistics.mean(r["loss"] for r in runs)
        per_step = statistics.median(r["step_s"] for r in runs) / statistics.median(r["step_s"] for r in ref)
        cost = f"{statistics.median(r['step_s'] for r in runs) * 1e3:.0f} ms ({per_step:.2f}x)"
        seeds = " / ".join(f"{r['loss']:.3f}" for r in runs)
        lines.append(
            f"| {row} | {seeds} | {mean:.3f} | "
            f"{mean - statistics.mean(r['loss'] for r in ref):+.3f} | {statistics.mean(r['bpb'] for r in runs):.3f} | "
            f"{statistics.mean(r['steps'] for r in runs):,.0f} | {cost} | {statistics.mean(r['wall'] for r in runs):.1f} |"
        )
    if not timed:
        lines.append(
            "\n(rows ran one after another: their wall s and time per step follow the load as it changed between"
            " them; --step-cost times steps interleaved)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", default="", help="--max-time budgets, comma-separated (e.g. 75s,35s)")
    parser.add_argument("--steps", default="", help="--max-iters budgets, comma-separated (quality per step)")
    parser.add_argument("--seeds", type=int, default=2, help="runs per row (seeds 1..N), interleaved")
    parser.add_argument("--rows", help=f"row names separated by semicolons (default: all): {'; '.join(ROWS)}")
    parser.add_argument("--flags", action="append", default=[], help="an extra row: its flags, quoted")
    parser.add_argument("--tokenizer", default="char", help="char, or bpe (the default tokenizer)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side (step budgets only)")
    parser.add_argument(
        "--step-cost",
        type=int,
        metavar="ROUNDS",
        help="time the rows' training steps in this process instead",
    )
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    chosen = args.rows.split(";") if args.rows else list(ROWS)
    unknown = [r for r in chosen if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {list(ROWS)}")
    rows = {name: ROWS[name] for name in chosen} | {flags: flags.split() for flags in args.flags}
    if args.step_cost:
        levers = [r for r in rows if r in LEVERS]
        print(f"load before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr)
        costs = step_costs(["the default", *levers], args.step_cost)
        print(f"\nseconds per CPU training step, {args.step_cost} interleaved rounds, medians; load after:")
        print(f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        print("\n".join(cost_table(costs)))
        return
    budgets = {f"--max-time {b}": ["--max-time", b] for b in filter(None, args.budget.split(","))}
    budgets |= {f"--max-iters {s}": ["--max-iters", s] for s in filter(None, args.steps.split(","))}
    if not budgets:
        raise SystemExit("give --budget, --steps or both")
    print(f"load before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr)
    measure_once(rows, args.tokenizer)
    for name, budget in budgets.items():
        jobs = args.jobs if name.startswith("--max-iters") else 1
        results: dict[str, list[Result]] = {row: [] for row in rows}
        for first in range(1, args.seeds + 1, jobs):
            seeds = range(first, min(first + jobs, args.seeds + 1))
            for row, flags in rows.items():
                with ThreadPoolExecutor(len(seeds)) as pool:
                    done = list(
                        pool.map(
                            run,
                            [flags] * len(seeds),
                            [budget] * len(seeds),
                            seeds,
                            [args.tokenizer] * len(seeds),
                        )
                    )
                results[row] += done
                for seed, r in zip(seeds, done, strict=True):
                    print(
                        f"  {row}, {name}, seed {seed}: {r['loss']:.4f} ({r['bpb']:.3f} bpb) at step {r['steps']:.0f}, "
                        f"{r['step_s'] * 1e3:.0f} ms/step, {r['wall']:.1f} s, load {os.getloadavg()[0]:.1f}",
                        file=sys.stderr,
                    )
        print(
            f"\n`minigpt train tinyshakespeare.txt --tokenizer {args.tokenizer} {name}` + each row's flags,"
        )
        print(
            f"{args.seeds} seed(s), whole commands, rows interleaved; load after: {os.getloadavg()[0]:.1f}\n"
        )
        print("\n".join(table(list(rows), results, next(iter(rows)), name.startswith("--max-time"))))


if __name__ == "__main__":
    main()
