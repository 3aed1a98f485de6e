"""What `minigpt generate` measures on this machine to decode, and what each choice buys: your machine's.

    python bench/bench_decode_choices.py                        # GPT-2 124M's shape: weights past the caches
    python bench/bench_decode_choices.py --shape 6x6x384 --vocab 65   # nanoGPT's char model: in the caches

Choices: a random model of the shape (speed does not depend on what the weights say) is loaded by the NumPy
engine as `minigpt generate` loads it, in a fresh cache directory, four times: the first three loads
measure (the tiling per batch width, the bands' prefetch distances per batch width, up to how many rows a
prefill's products go through the kernels), the fourth reads the answers, so the difference between the
first load's time and the fourth's is what measuring costs. The choices are printed.

Prefetch: one-token steps of 1, 2, 4, 8 and 16 rows with the float32 bands asking for their weights ahead at
each of `kernels.PREFETCHES`, round robin, medians: each distance's time over the time of the one the
engine chose for that width (1.00: as fast; 1.30: 30% slower), and the rule used before it was measured
(nothing at one row, 2k/16k from two rows on), so the table shows what the measurement bought.

Whole commands: `minigpt generate -s 8 -n N` on the saved run (a prefill, then steps of 8 rows) with the
distance the engine chose, and with MINIGPT_PREFETCH fixing each other one, interleaved, medians of wall
time (start-up and loading included).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # measure this checkout, not whatever minigpt is installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bandwidth import caches_line, cpu_model, load_line  # noqa: E402
from bench_generate import tokenizer  # noqa: E402

from minigpt.generate.engines import kernels  # noqa: E402
from minigpt.generate.engines.numpy_engine import (  # noqa: E402
    FETCH_ROWS,
    PREFETCH_ENV,
    NumpyEngine,
    prefetch_label,
)
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402

WIDTHS = (*FETCH_ROWS, 16)
RULE_BEFORE = {1: "none", 2: "2k/16k"}  # the constants decoding asked with before: nothing at one row


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="12x12x768", help="layers x heads x width (default GPT-2 124M's)")
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default GPT-2's)")
    ap.add_argument("--repeats", type=int, default=15, help="round-robin steps per distance (default 15)")
    ap.add_argument("--e2e-runs", type=int, default=5, help="whole commands per distance (default 5)")
    ap.add_argument("--e2e-tokens", type=int, default=100, help="tokens per sample, whole commands (100)")
    return ap.parse_args()


def config_of(shape: str, vocab: int) -> GPTConfig:
    n_layer, n_head, n_embd = (int(n) for n in shape.split("x"))
    return GPTConfig(vocab_size=vocab, block_size=256, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


def loads(config: GPTConfig, tensors: dict[str, np.ndarray]) -> tuple[NumpyEngine, list[float]]:
    """Four loads in the fresh cache: the engine of the last, and each load's seconds."""
    seconds, engine = [], None
    for _ in range(4):
        start = time.perf_counter()
        engine = NumpyEngine(config, tensors, layout="auto", kernels=True)
        seconds.append(time.perf_counter() - start)
    assert engine is not None
    return engine, seconds


def describe(engine: NumpyEngine, seconds: list[float]) -> list[str]:
    tiles = "; ".join(
        f"{rows} rows: {'rows' if t is None else f'tiles from {t}'}" for rows, t in engine.tiles.items()
    )
    fetch = "; ".join(
        f"{rows} row{'s' * (rows > 1)}: {prefetch_label(a)}" for rows, a in engine.prefetch.items()
    )
    prefill = "every prefill" if engine.kernel_rows > 10**9 else f"up to {engine.kernel_rows} rows"
    return [
        "| choice | what the engine measured |",
        "|---|---|",
        f"| blocks held as | {'float32 bands' if engine.bands else 'rows (widths not multiples of 16)'} |",
        f"| bands ask for weights ahead | {fetch} |",
        f"| batched steps by | {tiles} |",
        f"| prefill products by the kernels | {prefill} |",
        f"| loads (measuring x3, then reading) | {', '.join(f'{s:.2f} s' for s in seconds)} |",
    ]


def step_times(engine: NumpyEngine, repeats: int) -> dict[int, dict[str, float]]:
    """Median seconds of a one-token step for each width and distance, distances round robin."""
    chosen = dict(engine.prefetch)
    medians: dict[int, dict[str, float]] = {}
    for rows in WIDTHS:
        cache = engine.new_cache(rows, capacity=8)
        idx = np.zeros((rows, 1), dtype=np.int64)
        times: dict[str, list[float]] = {name: [] for name in kernels.PREFETCHES}
        for round_ in range(repeats + 1):
            for name, ahead in kernels.PREFETCHES.items():
                engine._use_prefetch(ahead)
                cache.reset()
                start = time.perf_counter()
                engine._forward(engine.weights, engine._head, idx, cache, False)
                if round_:  # the first round touches
                    times[name].append(time.perf_counter() - start)
        medians[rows] = {name: statistics.median(t) for name, t in times.items()}
    engine._use_prefetch(chosen)
    return medians


def prefetch_table(engine: NumpyEngine, medians: dict[int, dict[str, float]]) -> list[str]:
    """Each distance's median step over the chosen one's, a row per width, and the rule before."""
    names = list(kernels.PREFETCHES)
    lines = [
        "| rows | chosen | chosen step | " + " | ".join(names) + " | the rule before |",
        "|---:|---|---:|" + "---:|" * (len(names) + 1),
    ]
    for rows, times in medians.items():
        from_width = max(r for r in engine.prefetch if r <= rows)
        chosen = prefetch_label(engine.prefetch[from_width])
        base = times[chosen]
        before = RULE_BEFORE[max(r for r in RULE_BEFORE if r <= rows)]
        cells = " | ".join(f"{times[n] / base:.2f}" for n in names)
        lines.append(f"| {rows} | {chosen} | {base * 1e3:.2f} ms | {cells} | {times[before] / base:.2f} |")
    return lines


def whole_commands(run: Path, chosen: str, runs: int, tokens: int, cache_dir: str) -> list[str]:
    """`minigpt generate -s 8` with the engine's choice and each fixed distance, interleaved."""
    setups: dict[str, dict[str, str]] = {f"measured ({chosen} at 8 rows)": {}}
    setups.update({f"{PREFETCH_ENV}={name}": {PREFETCH_ENV: name} for name in kernels.PREFETCHES})
    clean = {
        k: v for k, v in os.environ.items() if k not in (PREFETCH_ENV, "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
    }
    cmd = [
        sys.executable,
        "-m",
        "minigpt",
        "generate",
        "-m",
        str(run),
        "-s",
        "8",
        "-n",
        str(tokens),
        "--seed",
        "1",
    ]

    def timed(env: dict[str, str]) -> float:
        start = time.perf_counter()
        subprocess.run(
            cmd,
            cwd=ROOT,
            check=True,
            capture_output=True,
            env={**clean, "MINIGPT_CACHE_DIR": cache_dir, **env},
        )
        return time.perf_counter() - start

    for env in setups.values():  # untimed: the first command of each reads its caches
        timed(env)
    times: dict[str, list[float]] = {what: [] for what in setups}
    for _ in range(runs):
        for what, env in setups.items():
            times[what].append(timed(env))
    base = statistics.median(times[next(iter(setups))])
    lines = ["| `minigpt generate -s 8` | median | over measured | each |", "|---|---:|---:|---|"]
    for what, each in times.items():
        median = statistics.median(each)
        lines.append(
            f"| {what} | {median:.2f} s | {median / base:.2f} | {', '.join(f'{t:.2f}' for t in each)} |"
        )
    return lines


def printed(lines: list[str]) -> None:
    print("\n".join(lines) + "\n", flush=True)


def main() -> None:
    args = arguments()
    config = config_of(args.shape, args.vocab)
    print(
        f"{cpu_model()}, {os.cpu_count()} CPUs; {caches_line()}; numpy {np.__version__}, numba {kernels.VERSION}; "
        f"{args.shape}, vocab {args.vocab}; load before: {load_line()}\n"
    )
    torch.manual_seed(0)
    model = GPT(config).eval()
    tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MINIGPT_CACHE_DIR"] = str(Path(tmp) / "cache")  # measured in this run, not read
        engine, seconds = loads(config, tensors)
        printed(describe(engine, seconds))
        if engine.bands:
            printed(prefetch_table(engine, step_times(engine, args.repeats)))
        RunDir(Path(tmp) / "run").save(model, tokenizer(args.vocab), extra={})
        chosen = prefetch_label(engine.prefetch[max(FETCH_ROWS)])
        printed(
            whole_commands(
                Path(tmp) / "run", chosen, args.e2e_runs, args.e2e_tokens, os.environ["MINIGPT_CACHE_DIR"]
            )
        )
    print(f"load after: {load_line()}")


if __name__ == "__main__":
    main()
