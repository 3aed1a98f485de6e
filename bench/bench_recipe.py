"""The CPU recipe and its ablations: whole `minigpt train` commands on tinyshakespeare under one time budget.

Each row is what a user waits for: `minigpt train tinyshakespeare.txt --tokenizer char --max-time B`
plus the row's flags, timed from launch to exit (tokenizing, model build, every eval and save included),
scored by the validation loss the command itself reports (its last eval, over the held-out last 10%).
Rows run interleaved (seed 1 of every row, then seed 2, ...) so a change in the machine's load during the
benchmark spreads over all of them.

    python bench/bench_recipe.py --budget 75s --seeds 2                  # the ablation table
    python bench/bench_recipe.py --budget 35s --rows "+ muon;+ rope"    # chosen rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

# every row starts from the CPU recipe before this benchmark (nano 2x128, block 64, batch 16, lr 8e-3, wsd,
# GPT-2's architecture, AdamW), changes one lever, then all the winning ones: today's default
BEFORE = ["--arch", "gpt2", "--optimizer", "adamw"]
ROWS: dict[str, list[str]] = {
    "the recipe before (gpt2, adamw)": BEFORE,
    "+ rope": [*BEFORE, "--pos", "rope"],
    "+ rmsnorm": [*BEFORE, "--norm", "rmsnorm"],
    "+ qk-norm": [*BEFORE, "--qk-norm"],
    "+ relu2": [*BEFORE, "--mlp", "relu2"],
    "+ swiglu": [*BEFORE, "--mlp", "swiglu"],
    "+ window 16 on layer 0": [*BEFORE, "--window", "16"],
    "+ untie": [*BEFORE, "--untie"],
    "+ no bias": [*BEFORE, "--no-bias"],
    "+ muon": [*BEFORE, "--optimizer", "muon"],
    "modern + muon (the default)": ["--arch", "modern", "--optimizer", "muon"],
}


def run(flags: list[str], budget: list[str], seed: int, tokenizer: str = "char") -> dict[str, float]:
    """One whole `minigpt train` command: its wall time, steps and the last validation loss it reports."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--out", str(out)]
        cmd += ["--tokenizer", tokenizer, *budget, "--seed", str(seed), *flags]
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache")}
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        evals = [
            r
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "eval"
        ]
        return dict(wall=wall, steps=evals[-1]["step"], loss=evals[-1]["val_loss"], bpb=evals[-1]["val_bpb"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", default="75s", help="--max-time of every command")
    parser.add_argument("--steps", type=int, help="--max-iters instead of a time budget (quality per step)")
    parser.add_argument("--seeds", type=int, default=2, help="runs per row (seeds 1..N), interleaved")
    parser.add_argument("--rows", help=f"row names separated by semicolons (default: all): {'; '.join(ROWS)}")
    parser.add_argument("--flags", action="append", default=[], help="an extra row: its flags, quoted")
    parser.add_argument(
        "--bpe", action="store_true", help="also the first and last rows with --tokenizer bpe"
    )
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    rows = {k: v for k, v in ROWS.items() if not args.rows or k in args.rows.split(";")}
    rows.update({flags: flags.split() for flags in args.flags})
    jobs = [(name, flags, "char") for name, flags in rows.items()]
    if args.bpe:
        for name in (next(iter(ROWS)), list(ROWS)[-1]):
            jobs.append((f"{name}, --tokenizer bpe", ROWS[name], "bpe"))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in jobs}
    budget = ["--max-iters", str(args.steps)] if args.steps else ["--max-time", args.budget]
    for seed in range(1, args.seeds + 1):
        for name, flags, tokenizer in jobs:
            results[name].append(run(flags, budget, seed, tokenizer))
            r = results[name][-1]
            print(
                f"  {name} seed {seed}: {r['loss']:.4f} ({r['bpb']:.3f} bpb) at step {r['steps']:.0f}, {r['wall']:.1f} s",
                file=sys.stderr,
            )
    base = statistics.mean(r["loss"] for r in next(iter(results.values())))
    print(
        f"\n`minigpt train tinyshakespeare.txt {' '.join(budget)}`, {args.seeds} seed(s) each, whole command\n"
    )
    print("| row | val loss (per seed) | mean | vs first row | bits per byte | steps | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        mean = statistics.mean(r["loss"] for r in runs)
        per_seed = " / ".join(f"{r['loss']:.3f}" for r in runs)
        print(
            f"| {name} | {per_seed} | {mean:.3f} | {mean - base:+.3f} | {statistics.mean(r['bpb'] for r in runs):.3f} "
            f"| {statistics.mean(r['steps'] for r in runs):.0f} | {statistics.mean(r['wall'] for r in runs):.1f} |"
        )


if __name__ == "__main__":
    main()
