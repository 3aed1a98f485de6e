"""How closely `minigpt train --max-time` keeps to its budget: the whole command's wall time, timed from outside.

Usage: python bench/bench_budget.py [--long] [--repeat N]   (prints a markdown table)
Trains on ../shared/data/tinyshakespeare.txt (--tokenizer char, the default CPU recipe) for 10 s and 60 s, and
5 min with --long, each with a cold token cache, as a user's first run. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def timed_run(seconds: int) -> dict:
    """Wall time of one `minigpt train --max-time {seconds}s`, from starting Python to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--tokenizer", "char",
               "--max-time", f"{seconds}s", "--out", str(out)]  # fmt: skip
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache")}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        last = json.loads((out / "config.json").read_text())["metrics"]["last"]
        over = [line for line in proc.stderr.splitlines() if line.startswith("over budget")]
        return dict(budget=seconds, wall=wall, steps=last["step"], message=over[0] if over else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long", action="store_true", help="also a 5 minute budget")
    parser.add_argument("--repeat", type=int, default=1, help="runs per budget")
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    budgets = [10, 60] + ([300] if args.long else [])
    print(
        "| budget | wall time (whole command) | wall - budget | within max(2%, 2 s) | steps | the run's own report |"
    )
    print("|---:|---:|---:|---|---:|---|")
    for seconds in budgets:
        for _ in range(args.repeat):
            r = timed_run(seconds)
            diff = r["wall"] - seconds
            ok = "yes" if abs(diff) <= max(0.02 * seconds, 2.0) else "no"
            print(
                f"| {seconds} s | {r['wall']:.2f} s | {diff:+.2f} s | {ok} | {r['steps']:,} | "
                f"{r['message'] or 'kept to the budget'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
