"""Which tokenizer learns tinyshakespeare best for the same CPU time? Validation bits per byte, char vs bpe.

Usage: python bench/bench_tokenizers.py [--seconds 60]   (prints a markdown table; run on an idle machine)
Bits per byte makes the tokenizers comparable: loss per token times tokens per byte, in bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SHAKESPEARE, run_recipe  # noqa: E402


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
        r = run_recipe([*choice, "--max-time", f"{args.seconds}s"], " ".join(choice[1:]))
        print(f"| {r['label']} | {r['wall']:.0f} s | {r['best']:.3f} | {r['bpb']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
