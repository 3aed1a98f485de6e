"""The trainer's per-step overhead, whole commands timed from outside: `minigpt train` vs a plain PyTorch loop.

Usage: python bench/bench_overhead.py [--repeats N]   (prints a markdown table)

Each side runs as a subprocess for 50 and for 350 steps on the 4x4x128, block 64, batch 12 char shape, fp32;
tokens/s = 300 steps x 12 x 64 / (t350 - t50), so start-up, tokenizing, the final evaluation and save cancel
and every per-step cost counts (logging, metrics, progress, syncs, batches). minigpt runs with its defaults
(a log line and metrics record every 10 steps, one final evaluation and save, none mid-way at 350 steps);
the plain loop evaluates and saves nothing. Both use minigpt's GPT module with GPT-2's architecture, fused AdamW with decay on the
weight matrices, the same warmup and wsd schedule and clipping at 1.0. `minigpt train` sets OpenMP's
spin-wait for itself (GOMP_SPINCOUNT: whichever it measured faster on this machine, else 10000), so the
plain loop also runs with 10000: with that choice, the row that isolates the trainer's own per-step work.
Repeats are interleaved; medians. bench/bench_cpu_choices.py compares the trainer with every measured
choice against the plain loop, at two shapes.
Needs ../shared/data/tinyshakespeare.txt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.time()  # as near the process's start as this script gets
ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
BATCH = 12
SHORT, LONG = 50, 350
ROWS = ("plain", "plain, short spin", "minigpt")
SPIN = "10000"  # GOMP_SPINCOUNT, as `minigpt train` sets it unless it measured otherwise


def textbook_gpt(vocab: int, n_layer: int, n_head: int, n_embd: int, block_size: int) -> Any:
    """GPT-2 as a user writes it from the paper or nanoGPT: nn.Linear and nn.LayerNorm, torch's
    scaled_dot_product_attention and cross_entropy, the head tied to the token embedding. For speed only:
    its initialisation is torch's defaults, with normal(0, 0.02) embeddings."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            self.mlp = nn.Sequential(
                nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = (
                t.view(B, T, n_head, C // n_head).transpose(1, 2)
                for t in self.c_attn(self.ln_1(x)).split(C, 2)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.c_proj(y)
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.02)
            self.h = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def plain_loop(
    steps: int,
    shape: dict[str, int] = SHAPE,
    batch: int = BATCH,
    seconds: float = 0.0,
    textbook: bool = False,
) -> None:
    """The textbook loop, run in this process: random windows (NumPy), forward, backward, clip, AdamW; on
    torch's default threads and OpenMP settings; minigpt's GPT module, or with `textbook` a GPT-2 written
    as a user would (`textbook_gpt`). With `seconds`, as many steps as fit in that much wall time from the
    process's start (as `minigpt train --max-time` counts), at most `steps`."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from minigpt.model.config import GPTConfig
    from minigpt.model.gpt import GPT

    text = SHAKESPEARE.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lut = {c: i for i, c in enumerate(chars)}
    data = np.array([lut[c] for c in text], dtype=np.int64)
    train = data[: len(data) - round(len(data) * 0.1)]
    torch.manual_seed(1337)
    model = textbook_gpt(len(chars), **shape) if textbook else GPT(GPTConfig(vocab_size=len(chars), **shape))
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wpe" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wpe" not in n)]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=8e-3, betas=(0.9, 0.99), fused=True)
    rng = np.random.default_rng(1337)
    T, warmup = shape["block_size"], min(100, steps // 10)
    done, loss = 0, torch.tensor(float("nan"))
    while done < steps and not (seconds and time.time() - START > seconds):
        p = done / steps
        lr = 8e-3 * (done + 1) / warmup if done < warmup else 8e-3 * min(1.0, (1 - p) / 0.5)
        for group in opt.param_groups:
            group["lr"] = lr
        ix = rng.integers(0, len(train) - T - 1, batch)
        x = torch.from_numpy(np.stack([train[i : i + T] for i in ix]))
        y = torch.from_numpy(np.stack([train[i + 1 : i + 1 + T] for i in ix]))
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done += 1
    print(f"plain loop: {done} steps, last loss {loss.item():.4f}", file=sys.stderr)


def timed(kind: str, steps: int, tmp: Path) -> float:
    """Wall seconds of one whole command, from starting Python to its exit."""
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("GOMP_SPINCOUNT", None)  # OpenMP's default, unless the row says otherwise
    if kind == "plain, short spin":
        env["GOMP_SPINCOUNT"] = SPIN  # what `minigpt train` sets for itself
    if kind.startswith("plain"):
        cmd = [sys.executable, __file__, "--plain-loop", str(steps)]
    else:
        out = tmp / f"run-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--tokenizer", "char",
               "--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64",
               "--batch-size", str(BATCH), "--max-iters", str(steps), "--device", "cpu",
               "--dtype", "float32", "--arch", "gpt2", "--optimizer", "adamw", "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument("--steps", type=int, nargs=2, default=[SHORT, LONG], help="the two step counts")
    parser.add_argument(
        "--rows", default=";".join(ROWS), help=f"which of {'; '.join(ROWS)} (separated by semicolons)"
    )
    parser.add_argument("--plain-loop", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # the plain loop's: layers,heads,width,block
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--textbook", action="store_true", help=argparse.SUPPRESS)  # the plain loop's model
    args = parser.parse_args()
    if args.plain_loop is not None:
        layers, heads, width, block = map(int, args.shape.split(",")) if args.shape else SHAPE.values()
        shape = dict(n_layer=layers, n_head=heads, n_embd=width, block_size=block)
        plain_loop(args.plain_loop, shape, args.batch, args.seconds, args.textbook)
        return
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    short_steps, long_steps = args.steps
    tokens = (long_steps - short_steps) * BATCH * SHAPE["block_size"]
    rates: dict[str, list[float]] = {k: [] for k in args.rows.split(";")}
    with tempfile.TemporaryDirectory() as tmp:
        timed("minigpt", 1, Path(tmp))  # fills the token cache, so tokenizing costs the same in every command
        for _ in range(args.repeats):
            for kind in rates:
                short, long = timed(kind, short_steps, Path(tmp)), timed(kind, long_steps, Path(tmp))
                rates[kind].append(tokens / (long - short))
                print(
                    f"{kind}: t{short_steps} {short:.2f} s, t{long_steps} {long:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"medians of {args.repeats} interleaved repeats; tokens/s = {tokens:,} / (t{long_steps} - t{short_steps})\n"
    )
    print("| 4x4x128, block 64, batch 12, char, fp32 | tokens/s | each repeat | vs the first row |")
    print("|---|---:|---:|---:|")
    labels = {"plain": "plain PyTorch loop", "plain, short spin": f"plain loop, GOMP_SPINCOUNT={SPIN}",
              "minigpt": "`minigpt train`"}  # fmt: skip
    base = med[next(iter(med))]  # the first row given: the plain loop unless --rows says otherwise
    for key in rates:
        each = ", ".join(f"{r:,.0f}" for r in rates[key])
        print(f"| {labels[key]} | {med[key]:,.0f} | {each} | {med[key] / base:.2f}x |")


if __name__ == "__main__":
    main()
