"""Tokenization throughput and peak memory of minigpt.data.dataset.prepare_data on a cold cache (markdown table).

Usage: python bench/bench_tokenize.py [--mb 50] [--big-mb 200] [--only bpe,r50k_base,char]

Each run is a fresh Python process, so its peak RSS is its own. Inputs are built under /tmp (tinyshakespeare
repeated to --mb MB, and --big-mb MB of shuffled tinyshakespeare lines) and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
SHAKESPEARE = DATA / "tinyshakespeare.txt"
R50K = DATA / "r50k_base.tiktoken"

# Runs in the child process: prepare_data on a cold cache, timed, with peak RSS from the kernel.
CHILD = r"""
import json, resource, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
sys.path.insert(0, args["root"])
import minigpt.data.dataset as data
from minigpt.tokenizer.load import tokenizer_from_json
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
tok = tokenizer_from_json(json.loads(Path(args["tokenizer_json"]).read_text())) if args["tokenizer_json"] else None
build_seconds = [0.0]
real_build = data.build_tokenizer
def timed_build(*a, **k):
    t = time.perf_counter()
    try:
        return real_build(*a, **k)
    finally:
        build_seconds[0] += time.perf_counter() - t
data.build_tokenizer = timed_build
base = rss_mb()
cfg = data.DataConfig(paths=(Path(args["input"]),), tokenizer=args["spec"], vocab_size=args["vocab_size"],
                      cache_dir=Path(args["cache"]))
t0, c0 = time.perf_counter(), time.process_time()
ds = data.prepare_data(cfg, 256, tokenizer=tok, progress=False)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"wall": wall, "cpu": cpu, "build": build_seconds[0], "tokens": len(ds.train) + len(ds.val),
                  "vocab": ds.tokenizer.vocab_size, "base_rss": base, "peak_rss": peak}))
"""


def make_repeated(source: str, path: Path, mb: float) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(max(1, round(mb * 1e6 / len(source.encode())))):
            f.write(source)


def make_shuffled(source: str, path: Path, mb: float) -> None:
    """Shuffled lines: big and varied enough that nothing repeats in long runs."""
    lines = [line for line in source.splitlines(keepends=True) if line.strip()]
    rng = random.Random(0)
    target, written = mb * 1e6, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = "".join(rng.choices(lines, k=20_000))
            f.write(chunk)
            written += len(chunk.encode())


def run(
    root: Path, spec: str, input_path: Path, work: Path, tokenizer_json: Path | None, vocab: int | None
) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    args = {
        "root": str(root),
        "spec": spec,
        "input": str(input_path),
        "cache": str(cache),
        "tokenizer_json": str(tokenizer_json) if tokenizer_json else None,
        "vocab_size": vocab,
    }
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(args)], check=True, capture_output=True, text=True
        ).stdout
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50, help="size of tinyshakespeare repeated (MB)")
    parser.add_argument(
        "--big-mb", type=float, default=200, help="size of the generated file for peak RSS (MB)"
    )
    parser.add_argument("--only", default="bpe,r50k_base,char", help="comma-separated tokenizers to run")
    opts = parser.parse_args()
    if not SHAKESPEARE.is_file() or not R50K.is_file():
        sys.exit(f"needs {SHAKESPEARE} and {R50K}")
    sys.path.insert(0, str(ROOT))
    from minigpt.tokenizer.base import default_threads
    from minigpt.tokenizer.bpe import BPETokenizer

    wanted = opts.only.split(",")
    source = SHAKESPEARE.read_text(encoding="utf-8")
    work = Path(tempfile.mkdtemp(prefix="minigpt-bench-"))
    try:
        repeated, big = work / "shakespeare_repeated.txt", work / "shuffled_lines.txt"
        make_repeated(source, repeated, opts.mb)
        make_shuffled(source, big, opts.big_mb)
        bpe_json = work / "bpe2048.json"
        bpe_json.write_text(json.dumps(BPETokenizer.train([source], 2048).to_json()))

        # (label, spec, input, pre-built tokenizer json, vocab_size)
        cases = []
        for name, path in (("tinyshakespeare repeated", repeated), ("shuffled lines", big)):
            if "bpe" in wanted:
                cases.append(("bpe 2048 (trained on tinyshakespeare)", "bpe", name, path, bpe_json, None))
            if "r50k_base" in wanted:
                cases.append(("r50k_base", str(R50K), name, path, None, None))
            if "char" in wanted:
                cases.append(("char", "char", name, path, None, None))
        if "bpe" in wanted:
            cases.append(("bpe 2048, trained in the run", "bpe", "shuffled lines", big, None, 2048))

        load = os.getloadavg()
        print("### Tokenization: `prepare_data` on a cold cache\n")
        print(
            f"{os.cpu_count()} CPUs, {default_threads()} tokenizer threads, Python {sys.version.split()[0]}, "
            f"load average {load[0]:.2f} at start (other jobs share this machine).\n"
        )
        print(
            "| tokenizer | input | MB | tokens | wall s | MB/s | CPU s | of which tokenizer training s | RSS after imports MB | peak RSS MB |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, spec, name, path, tok_json, vocab in cases:
            r = run(ROOT, spec, path, work, tok_json, vocab)
            mb = path.stat().st_size / 1e6
            print(
                f"| {label} | {name} | {mb:.0f} | {r['tokens']:,} | {r['wall']:.1f} | {mb / r['wall']:.1f} | "
                f"{r['cpu']:.1f} | {r['build']:.1f} | {r['base_rss']:.0f} | {r['peak_rss']:.0f} |",
                flush=True,
            )
        print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
