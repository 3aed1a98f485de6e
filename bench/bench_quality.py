"""What `--quantize int8` costs in quality on each engine: validation loss of a trained run in float32 and in
int8, on the NumPy engine (its kernels' int8 rows, float32 activations) and on the torch engine (the same
int8 values, bf16 inputs to torch's kernel).

The loss is the mean next-token cross-entropy over the text (the held-out last 10% of tinyshakespeare by
default) cut into windows of the run's block_size, each scored whole by one forward pass (`every_position`),
the same windows for every row. Prints a markdown table.

    minigpt train ../shared/data/tinyshakespeare.txt --tokenizer char --max-time 2m --out /tmp/q
    python bench/bench_int8_quality.py /tmp/q
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, not whatever minigpt is installed

from minigpt.engines import load_engine  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def loss(engine: object, ids: np.ndarray, block: int, batch: int = 16) -> float:
    """Mean cross-entropy (nats) of every next token of ids, over whole windows of block + 1 tokens."""
    n = (len(ids) - 1) // block
    windows = ids[: n * block + 1]
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = [windows[i * block : (i + 1) * block + 1] for i in range(start, min(n, start + batch))]
        x = [r[:-1].tolist() for r in rows]
        logits = np.asarray(engine.forward(x, None, every_position=True), dtype=np.float64)  # type: ignore[attr-defined]
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        targets = np.array([r[1:] for r in rows])
        total -= float(np.take_along_axis(logp, targets[..., None], -1).sum())
        count += targets.size
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a trained run directory")
    ap.add_argument("--text", type=Path, default=SHAKESPEARE, help="text to score (default tinyshakespeare)")
    ap.add_argument("--fraction", type=float, default=0.1, help="its last fraction scored (default 0.1)")
    args = ap.parse_args()
    text = args.text.read_text(encoding="utf-8")
    text = text[int(len(text) * (1 - args.fraction)) :]
    rows = []
    for backend in ("numpy", "torch"):
        losses = {}
        for quantize in ("none", "int8"):
            engine, tok = load_engine(args.run, backend, "cpu", "float32", quantize)
            ids = np.array(tok.encode(text))
            losses[quantize] = loss(engine, ids, engine.block_size)  # type: ignore[attr-defined]
        rows.append((backend, losses["none"], losses["int8"]))
    print(f"\n{args.run}: {len(ids):,} tokens of {args.text.name}'s last {args.fraction:.0%}\n")
    print("| engine | float32 loss | int8 loss | int8 - float32 |")
    print("| --- | ---: | ---: | ---: |")
    for backend, f32, i8 in rows:
        print(f"| {backend} | {f32:.5f} | {i8:.5f} | {i8 - f32:+.5f} |")


if __name__ == "__main__":
    main()
