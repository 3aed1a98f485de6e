"""One checkout's `minigpt generate` against another's: tokens/s of the same command, alternated.

Each pair runs the two checkouts' `python -m minigpt generate PROMPT -n N --seed S --json` one after the
other (which goes first alternates), as a user runs it, and reads the tokens/s the command reports (its
generation: prefill, steps and sampling; start-up and loading left out). Printed: each side's median and
the median of the pairs' ratios, which holds on a shared machine where the absolute numbers swing 2x.
Models: a run directory, or (`--make-run`) a random one of a preset's shape with the default tokenizer's
512 BPE tokens (nano: minigpt's CPU default, 2 layers of 128; small: 6 layers of 384), whose steps are
short enough that the Python around them shows.

    git worktree add /tmp/before HEAD~3
    python bench/bench_against.py --make-run /tmp/nano --preset nano
    python bench/bench_against.py --run /tmp/nano --against /tmp/before --threads auto --pairs 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def make_run(out: Path, preset: str, arch: str) -> None:
    """A random model of the preset's shape (block 256) with 512 BPE tokens learned from tinyshakespeare;
    its head scaled so that no sample ends early at <|endoftext|> (its row 0, every other logit 20x)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.model.presets import PRESETS, model_config
    from minigpt.runs.folder import RunDir
    from minigpt.tokenizer.bpe import BPETokenizer

    tok = BPETokenizer.train([SHAKESPEARE.read_text(encoding="utf-8")], vocab_size=512)
    shape = {k: v for k, v in PRESETS[preset].items() if k in ("n_layer", "n_head", "n_embd")}
    config = model_config(arch=arch, vocab_size=tok.vocab_size, block_size=256, **shape)
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[tok.eot_id] = 0.0
    RunDir(out).save(model, tok, extra={})
    print(f"wrote {out}: {preset} ({arch}), vocab {tok.vocab_size}")


def tokens_per_second(code: Path, run: Path, n: int, seed: int, threads: str) -> float:
    """What `minigpt generate --json` from the checkout `code` reports, in a clean environment."""
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in names}
    if threads != "auto":
        env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    cmd = [sys.executable, "-m", "minigpt", "generate", "ROMEO:", "-m", str(run), "-n", str(n),
           "--seed", str(seed), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=code)
    return float(json.loads(proc.stdout)["tokens_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-run", type=Path, help="write a random model here and stop")
    ap.add_argument("--preset", default="nano", help="its shape (--make-run; default nano)")
    ap.add_argument(
        "--arch", default="gpt2", choices=("gpt2", "modern"), help="its architecture (--make-run)"
    )
    ap.add_argument("--run", type=Path, help="the run directory both sides generate from")
    ap.add_argument("--against", type=Path, help="the other checkout")
    ap.add_argument("--threads", default="auto", help="OMP_NUM_THREADS for both, or auto (default)")
    ap.add_argument("--pairs", type=int, default=15, help="alternated pairs (default 15)")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens a command (default 200)")
    args = ap.parse_args()
    if args.make_run:
        make_run(args.make_run, args.preset, args.arch)
        return
    if not (args.run and args.against):
        ap.error("give --run and --against (or --make-run)")
    sides = {"this checkout": ROOT, str(args.against): args.against.resolve()}
    for code in sides.values():  # untimed: numba compiles a checkout's kernels once
        tokens_per_second(code, args.run, 5, 0, args.threads)
    speeds: dict[str, list[float]] = {name: [] for name in sides}
    load = os.getloadavg()
    for i in range(args.pairs):
        for name in list(sides)[:: 1 if i % 2 == 0 else -1]:
            speeds[name].append(tokens_per_second(sides[name], args.run, args.tokens, i, args.threads))
    here, there = speeds.values()
    ratios = [a / b for a, b in zip(here, there, strict=True)]
    print(
        f"{args.run.name}, {args.tokens} tokens, threads {args.threads}, {args.pairs} pairs; load "
        f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print("| checkout | tokens/s, median |")
    print("| --- | ---: |")
    for name, each in speeds.items():
        print(f"| {name} | {statistics.median(each):,.1f} |")
    print(
        f"\nthis checkout / the other: {statistics.median(ratios):.3f}x (median of the pairs' ratios; "
        f"ahead in {sum(r > 1 for r in ratios)} of {args.pairs})"
    )


if __name__ == "__main__":
    main()
