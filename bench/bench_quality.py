"""What `--quantize int8` and a float16 KV cache (`--kv-cache float16`) cost in quality, on each engine:
the validation loss of a trained run with float32 weights and cache, then with each change.

The loss is the mean next-token cross-entropy over the text (the held-out last 10% of tinyshakespeare by
default) cut into windows of the run's block_size, the same windows for every row. Weights are scored as
in round 4 (README, Benchmarks), each window whole by one forward pass without a cache (`every_position`);
the KV cache only matters where a cache is read, so its rows decode every window one token at a time
through the cache (the NumPy engine's compiled steps), as `generate` does, float32 cache then float16.
Prints a markdown table.

    minigpt train ../shared/data/tinyshakespeare.txt --tokenizer char --max-time 2m --out /tmp/q
    python bench/bench_quality.py /tmp/q
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, not whatever minigpt is installed

from minigpt.generate.load import load_engine  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def windows(ids: np.ndarray, block: int) -> np.ndarray:
    """Whole windows of block + 1 tokens (inputs and their next tokens), (n, block + 1)."""
    n = (len(ids) - 1) // block
    return np.stack([ids[i * block : (i + 1) * block + 1] for i in range(n)])


def nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed cross-entropy (nats) of targets under float logits (..., V)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return -float(np.take_along_axis(logp, targets[..., None], -1).sum())


def loss(engine: object, rows: np.ndarray, cached: bool, batch: int = 16) -> float:
    """Mean cross-entropy over every window of rows: each scored by one pass without a cache, or (`cached`)
    fed one token at a time through a KV cache, the logits of every step kept."""
    total = 0.0
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        x, targets = part[:, :-1], part[:, 1:]
        if not cached:
            total += nll(engine.forward(x.tolist(), None, every_position=True), targets)  # type: ignore[attr-defined]
            continue
        cache = engine.new_cache(len(part))  # type: ignore[attr-defined]
        for t in range(x.shape[1]):
            total += nll(engine.forward(x[:, t : t + 1].tolist(), cache), targets[:, t])  # type: ignore[attr-defined]
    return total / (rows.shape[0] * (rows.shape[1] - 1))


ROWS = [  # (engine, weights, KV cache, how the windows are read)
    ("numpy", "none", "float32", False),
    ("numpy", "int8", "float32", False),
    ("torch", "none", "float32", False),
    ("torch", "int8", "float32", False),
    ("numpy", "none", "float32", True),
    ("numpy", "none", "float16", True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a trained run directory")
    ap.add_argument("--text", type=Path, default=SHAKESPEARE, help="text to score (default tinyshakespeare)")
    ap.add_argument("--fraction", type=float, default=0.1, help="its last fraction scored (default 0.1)")
    args = ap.parse_args()
    text = args.text.read_text(encoding="utf-8")
    text = text[int(len(text) * (1 - args.fraction)) :]
    results = []
    for backend, quantize, kv_cache, cached in ROWS:
        engine, tok = load_engine(args.run, backend, "cpu", "float32", quantize, kv_cache=kv_cache)
        rows = windows(np.array(tok.encode(text)), engine.block_size)  # type: ignore[attr-defined]
        results.append((backend, quantize, kv_cache, cached, loss(engine, rows, cached)))
    print(f"\n{args.run}: {rows.size - len(rows):,} tokens of {args.text.name}'s last {args.fraction:.0%}\n")
    print("| engine | weights | KV cache | read | loss | change |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for backend, quantize, kv_cache, cached, value in results:
        ref = next(
            r[4] for r in results if r[0] == backend and r[1] == "none" and r[2:4] == ("float32", cached)
        )
        how = "one token at a time, cached" if cached else "whole windows, no cache"
        weights = "float32" if quantize == "none" else quantize
        print(f"| {backend} | {weights} | {kv_cache} | {how} | {value:.6f} | {value - ref:+.6f} |")


if __name__ == "__main__":
    main()
