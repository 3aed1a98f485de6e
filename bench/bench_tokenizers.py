"""Which tokenizer learns tinyshakespeare best for the same CPU time? Validation bits per byte, char vs bpe.

Usage: python bench/bench_tokenizers.py [--seconds 60]   (prints a markdown table; run on an idle machine)
Bits per byte makes the tokenizers comparable: loss per token times tokens per byte, in bits.
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


def run(tokenizer: list[str], seconds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache")}
        cmd = [
            sys.executable,
            "-m",
            "minigpt",
            "train",
            str(SHAKESPEARE),
            *tokenizer,
            "--max-time",
            f"{seconds}s",
            "--out",
            str(out),
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        metrics = json.loads((out / "config.json").read_text())["metrics"]
        return dict(wall=time.perf_counter() - t, loss=metrics["best_val_loss"], bpb=metrics["best_val_bpb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=60, help="training budget per tokenizer")
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    choices = [
        ["--tokenizer", "char"],
        ["--tokenizer", "bpe", "--vocab-size", "512"],
        ["--tokenizer", "bpe", "--vocab-size", "2048"],
    ]
    print(
        f"| tokenizer (default model, --max-time {args.seconds}s) | wall | val loss (nats/token) | val bits/byte |"
    )
    print("|---|---:|---:|---:|")
    for choice in choices:
        r = run(choice, args.seconds)
        print(
            f"| {' '.join(choice[1:])} | {r['wall']:.0f} s | {r['loss']:.3f} | {r['bpb']:.3f} |", flush=True
        )


if __name__ == "__main__":
    main()
