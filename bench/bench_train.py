"""Training benchmarks: matmul peak, minigpt vs a plain PyTorch loop (tokens/s, MFU), the CPU recipe.

Usage: python bench/bench_train.py [--skip-recipe] [--nanogpt]   (prints markdown tables)
Needs ../shared/data/tinyshakespeare.txt for the recipe part. Run it on an otherwise idle machine.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minigpt.data.dataset import DataConfig  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.model.params import count_params  # noqa: E402
from minigpt.train.loop import TrainConfig, train  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 3.0) -> float:
    """Best sustained GFLOP/s of an n x n matmul in this dtype."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        best = max(best, 5 * 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def plain_loop_tokens_per_s(config: GPTConfig, batch: int, steps: int, data: np.ndarray) -> float:
    """The baseline: the textbook fp32 loop (random windows, forward, backward, clip, AdamW) with the
    optimizer minigpt uses (fused AdamW, same betas), so the comparison is of the loop, not of one flag."""
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), fused=True)
    T = config.block_size
    rng = np.random.default_rng(0)
    t0 = 0.0
    for step in range(steps):
        if step == 10:
            t0 = time.perf_counter()
        ix = rng.integers(0, len(data) - T - 1, batch)
        x = torch.from_numpy(np.stack([data[i : i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + T] for i in ix]).astype(np.int64))
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (steps - 10) * batch * T / (time.perf_counter() - t0)


def minigpt_tokens_per_s(cfg: TrainConfig, text: Path, cache: Path, out: Path) -> tuple[float, str]:
    """Steady-state tokens/s of minigpt's trainer (from its own step log, first 10 steps excluded)."""
    result = train(
        cfg,
        DataConfig(paths=(text,), cache_dir=cache, tokenizer="char"),  # 65 characters, as the plain loop
        out=out,
        overwrite=True,
    )
    steps = [r for r in result.metrics if r["kind"] == "train"]
    first = next(r for r in steps if r["step"] >= 10)
    last = steps[-1]
    evals = sum(1 for r in result.metrics if r["kind"] == "eval")
    assert evals == 1, "the throughput run must not evaluate mid-way"
    return (last["tokens"] - first["tokens"]) / (last["elapsed"] - first["elapsed"]), str(cfg.dtype)


SHAPES = [
    (
        "nanoGPT CPU shape 4x4x128, block 64, batch 12",
        dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        12,
        300,
    ),
    ("6x6x384, block 256, batch 8", dict(n_layer=6, n_head=6, n_embd=384, block_size=256), 8, 40),
]


def _minigpt_rate(shape: dict, batch: int, steps: int, dtype: str, text: Path, tmp: Path) -> float:
    cfg = TrainConfig(
        preset="mini", overrides=shape, batch_size=batch, max_iters=steps, eval_every=10**9, eval_iters=1,
        log_every=1, device="cpu", dtype=dtype,
    )  # fmt: skip
    return minigpt_tokens_per_s(cfg, text, tmp / "cache", tmp / "run")[0]


def throughput(text: Path, peaks: dict[str, float], repeats: int = 3) -> list[dict]:
    """Per shape, the medians of `repeats` interleaved runs of: the plain fp32 loop, minigpt in fp32 (the
    implementation's gain, same dtype) and minigpt in bf16 autocast (what the dtype adds on top)."""
    data = np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.int64) % 65
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape, batch, steps in SHAPES:
            config = GPTConfig(vocab_size=65, **shape)
            runs: dict[str, list[float]] = {"plain": [], "float32": [], "bfloat16": []}
            for _ in range(repeats):
                runs["plain"].append(plain_loop_tokens_per_s(config, batch, steps, data))
                for dtype in ("float32", "bfloat16"):
                    runs[dtype].append(_minigpt_rate(shape, batch, steps, dtype, text, Path(tmp)))
            med = {k: statistics.median(v) for k, v in runs.items()}
            flops = count_params(config).flops_per_token["training"]
            rows.append(
                dict(
                    shape=label, plain=med["plain"], fp32=med["float32"], bf16=med["bfloat16"],
                    mfu_fp32=med["float32"] * flops / (peaks["fp32"] * 1e9),
                    mfu_bf16=med["bfloat16"] * flops / (peaks["bf16"] * 1e9),
                )
            )  # fmt: skip
    return rows


def run_recipe(args: list[str], label: str) -> dict:
    """Run `minigpt train` as a user would and read its best validation loss."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "minigpt",
            "train",
            str(SHAKESPEARE),
            "--out",
            str(out),
            *args,
        ]
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(Path(tmp) / "cache")}
        # a cold cache on purpose: the timed run includes tokenizing, as a user's first run does
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        config = json.loads((out / "config.json").read_text())
        # the whole validation split (the last 10% of the characters), scored by `minigpt eval` after
        # the timed run: the reference for the in-training estimate over evenly spaced windows
        text = SHAKESPEARE.read_text(encoding="utf-8")
        val_file = Path(tmp) / "val.txt"
        val_file.write_text(text[len(text) - round(len(text) * 0.1) :], encoding="utf-8")
        scored = subprocess.run(
            [
                sys.executable,
                "-m",
                "minigpt",
                "eval",
                str(out),
                str(val_file),
                "--json",
                "--batch-size",
                "256",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if scored.returncode != 0:
            raise SystemExit(scored.stderr)
        curve = [
            r
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "eval"
        ]
        return dict(
            label=label,
            wall=wall,
            best=config["metrics"]["best_val_loss"],
            whole_val=json.loads(scored.stdout)["loss"],
            bpb=config["metrics"]["best_val_bpb"],
            steps=config["metrics"]["last"]["step"],
            curve=[(r["elapsed"], r["val_loss"]) for r in curve],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-recipe", action="store_true", help="only the throughput tables")
    parser.add_argument("--nanogpt", action="store_true", help="also run nanoGPT's CPU recipe (~150 s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per throughput row (median)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")

    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(
        f"matmul peak on {torch.get_num_threads()} threads: fp32 {peaks['fp32']:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16']:.0f} GFLOP/s\n"
    )
    print(f"medians of {args.repeats} interleaved runs each\n")
    print(
        "| shape | plain loop fp32 | minigpt fp32 | implementation gain | minigpt bf16 autocast | bf16 gain | MFU fp32 / bf16 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in throughput(SHAKESPEARE, peaks, args.repeats):
        print(
            f"| {r['shape']} | {r['plain']:,.0f} | {r['fp32']:,.0f} | {r['fp32'] / r['plain']:.2f}x | "
            f"{r['bf16']:,.0f} | {r['bf16'] / r['fp32']:.2f}x | {100 * r['mfu_fp32']:.1f}% / {100 * r['mfu_bf16']:.1f}% |"
        )
    if args.skip_recipe:
        return
    recipes = [(["--tokenizer", "char", "--max-time", "75s"], "minigpt default CPU recipe, --max-time 75s")]
    if args.nanogpt:
        recipes.append(
            (
                [
                    "--tokenizer",
                    "char",
                    "--n-layer",
                    "4",
                    "--n-head",
                    "4",
                    "--n-embd",
                    "128",
                    "--block-size",
                    "64",
                    "--batch-size",
                    "12",
                    "--max-iters",
                    "2000",
                    "--lr",
                    "1e-3",
                    "--min-lr",
                    "1e-4",
                    "--warmup",
                    "100",
                    "--schedule",
                    "cosine",
                    "--eval-every",
                    "250",
                    "--eval-iters",
                    "20",
                    "--dtype",
                    "float32",
                ],
                "nanoGPT's CPU recipe (4x4x128, block 64, batch 12, 2000 iters)",
            )
        )
    print(
        "\n| recipe | wall time (whole command) | steps | best val loss (in training) | val bits/byte "
        "| same weights, whole val split |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for argv, label in recipes:
        r = run_recipe(argv, label)
        print(
            f"| {r['label']} | {r['wall']:.1f} s | {r['steps']:,} | {r['best']:.3f} | {r['bpb']:.3f} "
            f"| {r['whole_val']:.3f} |"
        )
        print("  curve (elapsed s, val loss): " + ", ".join(f"({t:.0f}, {v:.3f})" for t, v in r["curve"]))


if __name__ == "__main__":
    main()
