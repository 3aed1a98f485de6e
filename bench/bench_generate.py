"""Generation speed: the KV-cache engines against a plain full-recompute loop, and `minigpt generate` end to end.

Prints a markdown table. The model is nanoGPT's shakespeare_char shape (6 layers, 6 heads, 384 wide,
block 256, 65 characters) with random weights: speed does not depend on what the weights say.

    python bench/bench_generate.py              # 2 threads, 1000 tokens, ~3 minutes on 2 slow cores
    python bench/bench_generate.py --tokens 300 --skip-baseline
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, not whatever minigpt is installed
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `minigpt generate` sets them (see minigpt/cli.py)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from minigpt.config import GPTConfig  # noqa: E402
from minigpt.decode import Generation, default_slide, encode_prompt  # noqa: E402
from minigpt.engines.torch import TorchEngine, make_generator  # noqa: E402
from minigpt.model import GPT  # noqa: E402
from minigpt.rundir import RunDir  # noqa: E402
from minigpt.tokenizer import CharTokenizer  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CONFIG = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)


def tokenizer() -> CharTokenizer:
    if SHAKESPEARE.is_file():
        return CharTokenizer.from_text(SHAKESPEARE.read_text(encoding="utf-8"))
    return CharTokenizer(["\n"] + [chr(32 + i) for i in range(64)])  # same size, no data needed


def engine(model: GPT, tok: CharTokenizer, n: int) -> tuple[float, float]:
    """(seconds, time to first token) of an engine, as `minigpt generate` runs it, batch 1."""
    gen = Generation(
        TorchEngine(model), tok, encode_prompt(tok, ""), max_new_tokens=n, temperature=1.0, seed=0
    )
    gen.run()
    return gen.seconds, gen.time_to_first_token


@torch.inference_mode()
def full_recompute(model: GPT, tok: CharTokenizer, n: int) -> tuple[float, float]:
    """nanoGPT's sample loop: crop to the last block_size tokens, a full forward pass, sample, append."""
    generator = make_generator(0)
    idx = torch.tensor([encode_prompt(tok, "")])
    block_size = model.config.block_size
    t0 = time.perf_counter()
    first = 0.0
    for i in range(n):
        logits, _ = model(idx[:, -block_size:])
        probs = torch.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        if i == 0:
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


NUMPY_TIMING = """
import json, os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as `minigpt generate` sets it
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from minigpt.decode import Generation, encode_prompt
from minigpt.engines import load_engine
engine, tok = load_engine(Path(sys.argv[2]), "numpy")
times = []
for n in (20, int(sys.argv[3])):  # the first run warms up
    gen = Generation(engine, tok, encode_prompt(tok, ""), max_new_tokens=n, temperature=1.0, seed=0)
    gen.run()
    times = [gen.seconds, gen.time_to_first_token]
print(json.dumps(times), "torch" in sys.modules)
"""


def numpy_engine(run_dir: Path, n: int) -> tuple[float, float]:
    """(seconds, time to first token) of the NumPy engine in a process of its own, as `minigpt generate`
    runs it: no torch loaded, whose idle OpenMP threads would otherwise share the cores."""
    out = (
        subprocess.run(
            [sys.executable, "-c", NUMPY_TIMING, str(ROOT), str(run_dir), str(n)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .rsplit(" ", 1)
    )
    if out[-1] != "False":
        raise SystemExit("the NumPy engine imported torch")
    secs, ttft = json.loads(out[0])
    return secs, ttft


def end_to_end(
    run_dir: Path, n: int, runs: int, *extra: str, env: dict[str, str] | None = None
) -> list[float]:
    """Wall seconds of `python -m minigpt generate` as a user runs it: start-up, loading, generation."""
    cmd = [
        sys.executable,
        "-m",
        "minigpt",
        "generate",
        "ROMEO:",
        "-m",
        str(run_dir),
        "-n",
        str(n),
        "--seed",
        "1",
    ]
    run_env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT")}
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(
            [*cmd, *extra], cwd=ROOT, check=True, capture_output=True, env={**run_env, **(env or {})}
        )
        times.append(time.perf_counter() - t0)
    return times


def import_torch_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--tokens", type=int, default=1000, help="new tokens per measurement (default 1000)")
    ap.add_argument("--e2e-tokens", type=int, default=200, help="tokens for the end-to-end run (default 200)")
    ap.add_argument(
        "--e2e-runs", type=int, default=3, help="end-to-end repetitions, median shown (default 3)"
    )
    ap.add_argument("--skip-baseline", action="store_true", help="skip the slow full-recompute loop")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = tokenizer()
    model = GPT(CONFIG).eval()
    load_before = os.getloadavg()[0]
    n = args.tokens

    engine(model, tok, 20)  # warm-up: first-call allocations, thread pool start
    rows = []
    secs, ttft = engine(model, tok, n)
    engine_tps = n / secs
    rows.append(("KV-cache engine", "float32", secs, engine_tps, ttft))
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    engine(model_bf16, tok, 20)
    secs, ttft = engine(model_bf16, tok, n)
    rows.append(("KV-cache engine", "bfloat16", secs, n / secs, ttft))
    with tempfile.TemporaryDirectory() as tmp:
        RunDir(Path(tmp)).save(model, tok, extra={})
        secs, ttft = numpy_engine(Path(tmp), n)
    numpy_tps = n / secs
    rows.append(("NumPy KV-cache engine (`--backend numpy`)", "float32", secs, numpy_tps, ttft))
    if not args.skip_baseline:
        secs, ttft = full_recompute(model, tok, n)
        rows.append(("full recompute (nanoGPT loop)", "float32", secs, n / secs, ttft))

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        RunDir(run_dir).save(model, tok, extra={})
        e2e = {
            "`minigpt generate` (auto: the NumPy engine)": end_to_end(
                run_dir, args.e2e_tokens, args.e2e_runs
            ),
            "the same with `OPENBLAS_NUM_THREADS=2`": end_to_end(
                run_dir, args.e2e_tokens, args.e2e_runs, env={"OPENBLAS_NUM_THREADS": "2"}
            ),
            "`minigpt generate --backend torch`": end_to_end(
                run_dir, args.e2e_tokens, args.e2e_runs, "--backend", "torch"
            ),
        }
    torch_import = import_torch_seconds()
    load_after = os.getloadavg()[0]

    print(
        f"\n{CONFIG.n_layer} layers, {CONFIG.n_head} heads, {CONFIG.n_embd} wide, block {CONFIG.block_size}, "
        f"vocab {CONFIG.vocab_size}; batch 1, {n} new tokens, {args.threads} CPU threads, torch "
        f"{torch.__version__}, slide {default_slide(CONFIG.block_size)}; load average {load_before:.1f} "
        f"before, {load_after:.1f} after\n"
    )
    rows[0] = ("torch KV-cache engine (`--backend torch`)", *rows[0][1:])
    rows[1] = ("torch KV-cache engine (`--backend torch --dtype bfloat16`)", *rows[1][1:])
    print("| generation | dtype | seconds | tokens/s | time to first token |")
    print("| --- | --- | ---: | ---: | ---: |")
    for what, dtype, secs, tps, ttft in rows:
        print(f"| {what} | {dtype} | {secs:.2f} | {tps:.1f} | {ttft * 1000:.1f} ms |")
    if not args.skip_baseline:
        base = rows[-1][3]
        print(
            f"\nover full recompute (float32): torch engine **{engine_tps / base:.1f}x**, NumPy engine **{numpy_tps / base:.1f}x**"
        )
    print(
        f"\n| {args.e2e_tokens} tokens, end to end (start-up included) | median of {args.e2e_runs} | each |"
    )
    print("| --- | ---: | --- |")
    for what, times in e2e.items():
        print(f"| {what} | {statistics.median(times):.2f} s | {', '.join(f'{t:.2f}' for t in times)} |")
    print(f"| `python -c 'import torch'` alone | {torch_import:.2f} s | |")


if __name__ == "__main__":
    main()
