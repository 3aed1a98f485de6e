"""How closely `minigpt train --max-time` keeps to its budget: the whole command's wall time, timed from outside.

Usage: python bench/bench_budget.py [--rows char,gpt2,small] [--long] [--repeat N]   (prints a markdown table)
Trains on ../shared/data/tinyshakespeare.txt with a cold token cache, as a user's first run:
  char   the default CPU recipe with --tokenizer char, for 10 s and 60 s (5 min too with --long)
  gpt2   --arch gpt2 --tokenizer gpt2 for 90 s: a 50,257-token head, whose evaluations cost far more than
         steps of the 2x128 body (GPT-2's ranks read offline from ../shared/data, as TIKTOKEN_CACHE_DIR)
  small  --preset small (6 layers, 6 heads, 384 wide, block 256) with --tokenizer char, for 120 s
Each row reports the evaluations the run made and the batches each took (50 unless the budget scaled them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare.txt"
ROWS = {  # name: (label, budgets in seconds, flags)
    "char": ("default recipe, `--tokenizer char`", [10, 60], ["--tokenizer", "char"]),
    "gpt2": (
        "`--arch gpt2 --tokenizer gpt2` (50,257 tokens)",
        [90],
        ["--arch", "gpt2", "--tokenizer", "gpt2"],
    ),
    "small": (
        "`--preset small --tokenizer char` (6x6x384)",
        [120],
        ["--preset", "small", "--tokenizer", "char"],
    ),
}


def timed_run(seconds: int, flags: list[str]) -> dict:
    """Wall time of one `minigpt train --max-time {seconds}s FLAGS`, from starting Python to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), *flags, "--max-time", f"{seconds}s",
               "--out", str(out)]  # fmt: skip
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache"), "TIKTOKEN_CACHE_DIR": str(SHARED)}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        done = re.search(r"^done: .* after ([\d,]+) steps", proc.stderr, re.M)
        metrics = out / "metrics.jsonl"  # absent when no step or evaluation was logged
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        evals = [e for e in records if e["kind"] == "eval"]
        over = [line for line in proc.stderr.splitlines() if line.startswith("over budget")]
        return dict(
            wall=wall,
            steps=int(done.group(1).replace(",", "")) if done else -1,
            evals=", ".join(f"step {e['step']:,}: {e.get('eval_iters', 50)}" for e in evals) or "none",
            message=over[0] if over else "kept to the budget",
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="char,gpt2,small", help="which rows, comma-separated")
    parser.add_argument("--long", action="store_true", help="also a 5 minute budget for the char row")
    parser.add_argument("--repeat", type=int, default=1, help="runs per budget")
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    print("| run | budget | wall time (whole command) | wall - budget | within max(2%, 2 s) | steps | "
          "evaluations: batches | the run's own report |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---|---|")
    for name in args.rows.split(","):
        label, budgets, flags = ROWS[name]
        for seconds in budgets + ([300] if args.long and name == "char" else []):
            for _ in range(args.repeat):
                r = timed_run(seconds, flags)
                diff = r["wall"] - seconds
                ok = "yes" if abs(diff) <= max(0.02 * seconds, 2.0) else "no"
                print(
                    f"| {label} | {seconds} s | {r['wall']:.2f} s | {diff:+.2f} s | {ok} | {r['steps']:,} | "
                    f"{r['evals']} | {r['message']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
