"""The attention scores side by side: `minigpt train tinyshakespeare.txt --tokenizer char --attn-score S` for
scaled, dot, general and additive, at head sizes 16 and 64, under the same number of steps and under the same
time budget; prints the README's table.

Every run is a whole command from the CPU recipe (nano: 2 layers, 128 wide, block 64, batch 16, rotary,
RMSNorm, SwiGLU, Muon), with `--n-head 8` (d_head 16) or `--n-head 2` (d_head 64), one evaluation at the end
(its validation loss over the held-out last 10%). Per run: the steps taken, tokens/s (between the first and
last logged steps), the peak resident memory of the process (os.wait4), and the spread of the attention
logits at initialisation and in the trained model: the standard deviation of each query's logits over the
keys it may see (the spread its softmax sees: a constant per query, like additive's vᵀW₁q, cancels in the
softmax), averaged over queries, heads and layers on 16 validation windows. Runs are interleaved (each
round runs every score once per head size, in a rotating order) and the machine's load is printed.

    python bench/bench_attn_score.py                           # 300 steps, then 90 s, one round
    python bench/bench_attn_score.py --steps 600 --time 0      # equal steps only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minigpt.model import gpt as tm
from minigpt.model.config import SCORES
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
HEADS = {16: 8, 64: 2}  # d_head -> n_head at n_embd 128
SEED = 1337


def logit_spread(model: GPT, windows: torch.Tensor) -> float:
    """Mean over queries (with at least two visible keys), heads and layers of the standard deviation of a
    query's logits over the keys it may see, as the model's own explicit attention path computes them."""
    spreads: list[torch.Tensor] = []
    original = tm.attention_logits

    def recording(w: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = original(w, q, k)
        T = logits.size(-1)
        visible = tm.attention_mask(T, T, w.window, logits.device)
        x = logits.masked_fill(~visible, 0.0)
        n = visible.sum(-1)
        mean = x.sum(-1) / n
        var = ((x - mean[..., None]) ** 2).masked_fill(~visible, 0.0).sum(-1) / n
        spreads.append(var.sqrt()[..., n > 1].flatten())
        return logits

    tm.attention_logits = recording  # type: ignore[assignment]
    try:
        with torch.no_grad():
            model.eval()(windows, attention=[])
    finally:
        tm.attention_logits = original  # type: ignore[assignment]
    return torch.cat(spreads).mean().item()


def val_windows(run: RunDir, block: int, n: int = 16) -> torch.Tensor:
    """n windows of block tokens, evenly spaced over the last 10% of the text (the validation split)."""
    _, tokenizer, _ = run.load_model()
    text = SHAKESPEARE.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[int(len(text) * 0.9) :])
    starts = torch.linspace(0, len(ids) - block - 1, n).long().tolist()
    return torch.tensor([ids[s : s + block] for s in starts])


def train(score: str, d_head: int, budget: list[str], tmp: Path) -> dict[str, float]:
    """One whole `minigpt train` command and what it reports."""
    out = tmp / f"{score}-{d_head}-{time.monotonic_ns()}"
    flags = (
        f"--tokenizer char --attn-score {score} --n-head {HEADS[d_head]} --seed {SEED} --eval-every 1000000"
    )
    cmd = [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--out", str(out), *flags.split()]
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(tmp / "cache")}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, *budget], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{stderr.decode()[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    last_eval = [r for r in records if r["kind"] == "eval"][-1]
    run = RunDir(out)
    config = run.model_config()
    windows = val_windows(run, config.block_size)
    torch.manual_seed(SEED)  # the run's seed before building its model
    return dict(
        wall=wall,
        steps=last_eval["step"],
        loss=last_eval["val_loss"],
        tokens_per_s=tokens_per_s([*steps, last_eval]),
        peak_mib=usage.ru_maxrss / 1024,
        spread_init=logit_spread(GPT(config), windows),
        spread_end=logit_spread(run.load_model()[0], windows),
    )


def tokens_per_s(steps: list[dict[str, Any]]) -> float:
    """Tokens a second between the first logged step (its start-up left out) and the final evaluation
    (its training clock stops before evaluating), or over the whole run when a short one logged neither."""
    first, last = steps[0], steps[-1]
    if last["elapsed"] > first["elapsed"]:
        return (last["tokens"] - first["tokens"]) / (last["elapsed"] - first["elapsed"])
    return last["tokens"] / last["elapsed"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def table(title: str, results: dict[tuple[int, str], list[dict[str, float]]]) -> None:
    print(f"\n{title}\n")
    print(
        "| d_head | score | steps | val loss | tokens/s | vs scaled | peak RSS MiB | logit spread init | end |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for (d_head, score), runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        scaled = results.get((d_head, "scaled"), [])
        base = statistics.median(r["tokens_per_s"] for r in scaled) if scaled else 0.0
        ratio = f"{m['tokens_per_s'] / base:.2f}x" if base else "n/a"  # no scaled run, or no steps timed
        print(
            f"| {d_head} | {score} | {m['steps']:.0f} | {m['loss']:.3f} | {m['tokens_per_s']:,.0f} "
            f"| {ratio} | {m['peak_mib']:.0f} | {m['spread_init']:.2f} | {m['spread_end']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="--max-iters of the equal-steps rows (0: none)"
    )
    parser.add_argument("--time", type=float, default=90, help="--max-time of the equal-time rows (0: none)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every row, interleaved (medians shown)"
    )
    parser.add_argument("--scores", default=",".join(SCORES), help="comma-separated")
    parser.add_argument("--heads", default="16,64", help="head sizes, comma-separated (16 and/or 64)")
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    scores = args.scores.split(",")
    heads = [int(h) for h in args.heads.split(",")]
    budgets = {f"{args.steps} steps": ["--max-iters", str(args.steps)]} if args.steps else {}
    if args.time:
        budgets[f"{args.time:g} s"] = ["--max-time", f"{args.time:g}", "--max-iters", "1000000"]
    print(
        f"# {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, load {load()}",
        file=sys.stderr,
    )
    loads = [load()]
    with tempfile.TemporaryDirectory() as tmp:
        for name, budget in budgets.items():
            results: dict[tuple[int, str], list[dict[str, float]]] = {
                (h, s): [] for h in heads for s in scores
            }
            for r in range(args.rounds):
                for d_head in heads:
                    for i in range(len(scores)):
                        score = scores[(i + r) % len(scores)]
                        results[(d_head, score)].append(train(score, d_head, budget, Path(tmp)))
                        x = results[(d_head, score)][-1]
                        loads.append(load())
                        print(
                            f"  {name} d_head {d_head} {score}: {x} (load {loads[-1]})",
                            file=sys.stderr,
                            flush=True,
                        )
            table(
                f"Equal budget: {name} (`--max-iters` / `--max-time`), {args.rounds} round(s), medians",
                results,
            )
    print(
        f"\n{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}; 1-min load averages around the runs:"
    )
    print(", ".join(loads))


if __name__ == "__main__":
    main()
