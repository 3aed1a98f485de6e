"""Generation speed: each engine's cached decoding against the memory-bandwidth bound, and end to end.

Prints markdown tables. The model is nanoGPT's shakespeare_char shape (6 layers, 6 heads, 384 wide,
block 256, 65 characters) with random weights: speed does not depend on what the weights say.

A cached step reads every weight once, however many rows it decodes, so a step cannot be faster than
(bytes of weights it reads) / (memory bandwidth). The benchmark measures this machine's bandwidth itself
(a float32 matrix-vector product over a 256 MB matrix, far larger than the caches) and reports each
engine's tokens/s as a fraction of that bound: 1.0 would be a step that does nothing but stream weights.
At batch N the bound is N times the batch-1 bound (one weight read serves N rows); the KV cache each row
also reads is left out of it. Weights that fit in the last-level cache (int8, bf16) can beat the bound.

The last table decodes past the block: a rotary model's ring-buffer cache against the learned-position
slide, tokens/s over --e2e-tokens and over --long new tokens at batch 1 (the rotary ratio should stay
near 1: constant work per token however long the text).

Engines are timed as `minigpt generate` runs them (`load_engine` on a saved run, the decode loop and its
text), round-robin over engines and batch sizes, `--repeats` times, medians shown: the machine may be
shared, and interleaving spreads the noise over every row alike.

    python bench/bench_generate.py                       # ~5 minutes on 2 slow cores
    python bench/bench_generate.py --repeats 1 --skip-baseline --e2e-runs 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, not whatever minigpt is installed
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `minigpt generate` sets them (see minigpt/cli.py)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from minigpt.config import GPTConfig  # noqa: E402
from minigpt.decode import Engine, Generation, encode_prompt  # noqa: E402
from minigpt.engines import load_engine  # noqa: E402
from minigpt.engines.torch import make_generator  # noqa: E402
from minigpt.model import GPT  # noqa: E402
from minigpt.rundir import RunDir  # noqa: E402
from minigpt.tokenizer import CharTokenizer, Tokenizer  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CONFIG = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
# (label, backend, dtype, quantize): what `minigpt generate --backend B --dtype D --quantize Q` runs
TORCH_ENGINES = [
    ("torch", "torch", "float32", "none"),
    ("torch `--dtype bfloat16`", "torch", "bfloat16", "none"),
    ("torch `--quantize int8`", "torch", "float32", "int8"),
]
NUMPY_ENGINE = ("NumPy (one BLAS thread)", "numpy", "float32", "none")
E2E: list[tuple[str, tuple[str, ...], dict[str, str]]] = [  # (what, extra options, environment)
    ("`minigpt generate` (auto: the NumPy engine)", (), {}),
    ("the same with `OPENBLAS_NUM_THREADS=2`", (), {"OPENBLAS_NUM_THREADS": "2"}),
    ("`minigpt generate --backend torch`", ("--backend", "torch"), {}),
    ("`minigpt generate --quantize int8`", ("--quantize", "int8"), {}),
]


def tokenizer() -> CharTokenizer:
    if SHAKESPEARE.is_file():
        return CharTokenizer.from_text(SHAKESPEARE.read_text(encoding="utf-8"))
    return CharTokenizer(["\n"] + [chr(32 + i) for i in range(64)])  # same size, no data needed


# --- the bound ------------------------------------------------------------------------------------------


def bandwidth(threads: int, repeats: int = 15) -> float:
    """Bytes/s a float32 matrix-vector product streams from a 256 MB matrix: the best of `repeats`, as
    STREAM reports, since a shared machine only ever slows a run down."""
    torch.set_num_threads(threads)
    matrix, vector = torch.randn(8192, 8192), torch.randn(8192)
    torch.mv(matrix, vector)  # first touch and thread start-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - t0)
    return matrix.nbytes / min(times)


def step_bytes(tree: Any) -> int:
    """Bytes of weights a one-token step reads from a weight tree (torch or NumPy): everything, except
    that the embedding tables give one row each (the head, tied or not, is read whole)."""
    if dataclasses.is_dataclass(tree):
        total = 0
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name)
            if field.name in ("wte", "wpe"):
                total += 0 if value is None else value[0].nbytes
            else:
                total += step_bytes(value)
        return total
    if isinstance(tree, (tuple, list)):
        return sum(step_bytes(t) for t in tree)
    return int(getattr(tree, "nbytes", 0))


# --- timing ---------------------------------------------------------------------------------------------


def tokens_per_second(engine: Engine, tok: Tokenizer, n: int, batch: int) -> tuple[float, float]:
    """(aggregate tokens/s, time to first token) of `batch` samples of n tokens, as `minigpt generate`."""
    gen = Generation(
        engine, tok, encode_prompt(tok, ""), max_new_tokens=n, num_samples=batch, temperature=1.0, seed=0
    )
    gen.run()
    return gen.tokens_per_second, gen.time_to_first_token


NUMPY_TIMING = """
import json, os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as `minigpt generate` sets it
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from minigpt.decode import Generation, encode_prompt
from minigpt.engines import load_engine
engine, tok = load_engine(Path(sys.argv[2]), "numpy")
n, batches = int(sys.argv[3]), json.loads(sys.argv[4])
Generation(engine, tok, encode_prompt(tok, ""), max_new_tokens=20).run()  # warm-up
out = []
for batch in batches:
    gen = Generation(engine, tok, encode_prompt(tok, ""), max_new_tokens=n, num_samples=batch, seed=0,
                     temperature=1.0)
    gen.run()
    out.append([gen.tokens_per_second, gen.time_to_first_token])
print(json.dumps(out), "torch" in sys.modules)
"""


def numpy_round(run_dir: Path, n: int, batches: list[int]) -> list[tuple[float, float]]:
    """One round of the NumPy engine over every batch size, in a process of its own as `minigpt generate`
    runs it: no torch loaded, whose idle OpenMP threads would otherwise share the cores."""
    out = subprocess.run(
        [sys.executable, "-c", NUMPY_TIMING, str(ROOT), str(run_dir), str(n), json.dumps(batches)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if out[-1] != "False":
        raise SystemExit("the NumPy engine imported torch")
    return [(tps, ttft) for tps, ttft in json.loads(" ".join(out[:-1]))]


def numpy_bytes(run_dir: Path) -> int:
    engine, _ = load_engine(run_dir, "numpy")
    return step_bytes(engine.weights)  # type: ignore[attr-defined]


@torch.inference_mode()
def full_recompute(model: GPT, tok: Tokenizer, n: int) -> float:
    """Tokens/s of nanoGPT's sample loop: crop to the last block_size tokens, a full pass, sample, append."""
    generator = make_generator(0)
    idx = torch.tensor([encode_prompt(tok, "")])
    t0 = time.perf_counter()
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        probs = torch.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return n / (time.perf_counter() - t0)


def end_to_end(run_dir: Path, n: int, runs: int, *extra: str, env: dict[str, str]) -> list[float]:
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
        subprocess.run([*cmd, *extra], cwd=ROOT, check=True, capture_output=True, env={**run_env, **env})
        times.append(time.perf_counter() - t0)
    return times


def import_torch_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


# --- the report -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    label: str
    dtype: str
    quantize: str
    bytes_per_step: int
    speeds: dict[int, list[float]]  # batch -> aggregate tokens/s of every repeat
    first_token: list[float]  # seconds, batch 1

    def median(self, batch: int) -> float:
        return statistics.median(self.speeds[batch])


def measure(
    run_dir: Path, tok: Tokenizer, n: int, batches: list[int], repeats: int, threads: int
) -> list[Row]:
    """Every engine at every batch size, round-robin, `repeats` times."""
    torch.set_num_threads(threads)
    engines: dict[str, Engine] = {}
    rows = []
    for label, backend, dtype, quantize in TORCH_ENGINES:
        engines[label], _ = load_engine(run_dir, backend, "cpu", dtype, quantize)
        bytes_read = step_bytes(engines[label].weights)  # type: ignore[attr-defined]
        rows.append(Row(label, dtype, quantize, bytes_read, {b: [] for b in batches}, []))
        tokens_per_second(engines[label], tok, 20, 1)  # warm-up: first-call allocations, thread start
    label, _, dtype, quantize = NUMPY_ENGINE
    rows.append(Row(label, dtype, quantize, numpy_bytes(run_dir), {b: [] for b in batches}, []))
    for _ in range(repeats):
        for row in rows:
            if row.label in engines:
                results = [tokens_per_second(engines[row.label], tok, n, b) for b in batches]
            else:
                results = numpy_round(run_dir, n, batches)
            for batch, (tps, ttft) in zip(batches, results, strict=True):
                row.speeds[batch].append(tps)
                if batch == 1:
                    row.first_token.append(ttft)
    return rows


# --- past the block: rotary ring buffer against the learned-position slide ------------------------------


def past_the_block(tok: Tokenizer, short: int, long: int, repeats: int) -> list[tuple[str, float, float]]:
    """Batch-1 tokens/s over `short` and `long` new tokens, for a rotary model (its ring-buffer cache) and
    a learned-position one (slides and re-reads its window), on each engine, round-robin, medians."""
    engines: dict[str, Engine] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pos in ("rope", "learned"):
            run_dir = Path(tmp) / pos
            RunDir(run_dir).save(GPT(dataclasses.replace(CONFIG, pos=pos)).eval(), tok, extra={})
            for backend in ("torch", "numpy"):
                engines[f"{pos}, {backend}"], _ = load_engine(run_dir, backend, "cpu", "float32", "none")
        speeds: dict[str, dict[int, list[float]]] = {name: {short: [], long: []} for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                for n in (short, long):
                    speeds[name][n].append(tokens_per_second(engine, tok, n, 1)[0])
    return [(name, statistics.median(s[short]), statistics.median(s[long])) for name, s in speeds.items()]


def print_rows(rows: list[Row], batches: list[int], bw: float) -> None:
    print(
        f"| engine | weights | MB read per step | {' | '.join(f'batch {b}' for b in batches)} | first token |"
    )
    print(f"| --- | --- | ---: | {' | '.join('---:' for _ in batches)} | ---: |")
    for row in rows:
        bound = bw / row.bytes_per_step
        cells = [f"{row.median(b):,.0f} ({row.median(b) / (b * bound):.2f})" for b in batches]
        weights = row.dtype if row.quantize == "none" else f"{row.quantize} (activations {row.dtype})"
        ttft = statistics.median(row.first_token) * 1000 if row.first_token else float("nan")
        print(
            f"| {row.label} | {weights} | {row.bytes_per_step / 1e6:.1f} | {' | '.join(cells)} | {ttft:.1f} ms |"
        )


def print_header(args: argparse.Namespace, bw: dict[int, float], load_before: float) -> None:
    print(
        f"\n{CONFIG.n_layer} layers, {CONFIG.n_head} heads, {CONFIG.n_embd} wide, block {CONFIG.block_size}, "
        f"vocab {CONFIG.vocab_size}; {args.tokens} new tokens per sample, torch {torch.__version__} with "
        f"{args.threads} threads; medians of {args.repeats} round-robin repeats; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(
        f"memory bandwidth (float32 matrix-vector product, 256 MB): {bw[2] / 1e9:.1f} GB/s with 2 threads, "
        f"{bw[1] / 1e9:.1f} GB/s with 1; the bound below uses the higher\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as `minigpt generate`)"
    )
    ap.add_argument(
        "--tokens", type=int, default=250, help="new tokens per sample, inside the block (default 250)"
    )
    ap.add_argument("--batches", default="1,4,8,16", help="batch sizes, comma-separated (default 1,4,8,16)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin repeats, median shown (default 3)")
    ap.add_argument("--e2e-tokens", type=int, default=200, help="tokens for the end-to-end run (default 200)")
    ap.add_argument(
        "--e2e-runs", type=int, default=3, help="end-to-end repetitions, median shown (default 3)"
    )
    ap.add_argument("--skip-baseline", action="store_true", help="skip the slow full-recompute loop")
    ap.add_argument(
        "--long",
        type=int,
        default=4000,
        help="new tokens for the past-the-block table (default 4000; 0 skips it)",
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    torch.manual_seed(0)
    tok = tokenizer()
    model = GPT(CONFIG).eval()
    load_before = os.getloadavg()[0]
    bw = {threads: bandwidth(threads) for threads in (1, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        RunDir(run_dir).save(model, tok, extra={})
        rows = measure(run_dir, tok, args.tokens, batches, args.repeats, args.threads)
        print_header(args, bw, load_before)
        print("aggregate tokens/s (fraction of the bandwidth bound: N x bandwidth / bytes read per step)\n")
        print_rows(rows, batches, max(bw.values()))
        if not args.skip_baseline:
            baseline = full_recompute(model, tok, args.tokens)
            print(f"\nfull recompute (nanoGPT's loop, float32, batch 1): {baseline:.1f} tokens/s")
        print(
            f"\n| {args.e2e_tokens} tokens, end to end (start-up included) | median of {args.e2e_runs} | each |"
        )
        print("| --- | ---: | --- |", flush=True)
        for what, extra, env in E2E:
            times = end_to_end(run_dir, args.e2e_tokens, args.e2e_runs, *extra, env=env)
            print(
                f"| {what} | {statistics.median(times):.2f} s | {', '.join(f'{t:.2f}' for t in times)} |",
                flush=True,
            )
    print(f"| `python -c 'import torch'` alone | {import_torch_seconds():.2f} s | |")
    if args.long:
        print(
            f"\n| batch 1, past block {CONFIG.block_size} | {args.e2e_tokens} new tokens | {args.long} new tokens | ratio |"
        )
        print("| --- | ---: | ---: | ---: |", flush=True)
        for name, short, long in past_the_block(tok, args.e2e_tokens, args.long, args.repeats):
            print(f"| {name} | {short:,.0f} | {long:,.0f} | {long / short:.2f} |", flush=True)


if __name__ == "__main__":
    main()
