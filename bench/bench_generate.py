"""Generation speed: each engine's cached decoding against the memory-bandwidth bound, and end to end.

Prints the README's markdown tables. The models are, by default, nanoGPT's shakespeare_char shape (6
layers, 6 heads, 384 wide, block 256, 65 characters), or any other (`--shape LxHxC --vocab V --block B`;
GPT-2 124M's: `--shape 12x12x768 --vocab 50257 --block 1024`, 498 MB of float32 weights), in GPT-2's
architecture and in `--arch modern` (rotary, RMSNorm, SwiGLU, untied), with random weights: speed does
not depend on what the weights say.

A cached step reads every weight once, however many rows it decodes, so a step cannot be faster than
(bytes of weights it reads) / (memory bandwidth). The benchmark measures this machine's bandwidth in the
same run, before each round so it sees the same load: a read-only stream over an array four times the
last-level cache (read from the machine; bench/bandwidth.py), on one thread and on every core, the best
of 3 passes. Each engine's tokens/s is shown as a fraction of the bound on its thread count (one thread,
else every core): 1.0 would be a step that does nothing but stream weights. At batch N the bound is N
times the batch-1 bound (one weight read serves N rows); the KV cache each row also reads is left out of
it. Weights that fit in the last-level cache (the 6x6x384 model's, and int8's) can beat it.

Engines are timed as `minigpt generate` runs them: `load_engine` on a saved run (which loads the NumPy
engine's compiled kernels, or picks the weights' layout by timing where they do not run), the decode loop
and its text, with the threads the engine chooses itself (minigpt.generate.engines.tuning: its first steps try each
count) and, for the NumPy engine, with one thread; its int8 form (`--quantize int8`), its KV cache in
float32 (`--kv-cache float32`; generate's default holds it in float16) and its array path (the engine
without the kernels) for comparison.
The NumPy engine runs in a process of its own, as `generate` runs it, without torch. Everything is
measured round-robin, `--repeats` times, medians shown: on a shared machine interleaving spreads the
noise over every row alike, and the ratios (to the bound, batch 8 to batch 1, int8 to float32) hold
better than the absolute numbers; a ratio of two setups is the median of the rounds' ratios (each round
measures both within a minute).

The last tables time whole `minigpt generate` commands (start-up, loading, generation) and decoding past
the block (a rotary model's ring-buffer cache against the learned-position slide).

    python bench/bench_generate.py                       # ~5 minutes on 2 slow cores
    python bench/bench_generate.py --repeats 1 --skip-baseline --e2e-runs 1 --long 0
    python bench/bench_generate.py --shape 12x12x768 --vocab 50257 --block 1024 --archs GPT-2 --tokens 100 \
        --skip-baseline --e2e-tokens 100 --long 0            # GPT-2 124M's shape: weights past the caches
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
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `minigpt generate` sets it (see minigpt/cli/main.py)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bandwidth import caches_line, cpu_model, load_line, stream_bytes, stream_read  # noqa: E402

from minigpt.generate.decode import Engine, Generation, encode_prompt  # noqa: E402
from minigpt.generate.engines.torch_engine import make_generator  # noqa: E402
from minigpt.generate.load import load_engine  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.model.presets import model_config  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.tokenizer.base import Tokenizer  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def architectures(shape: str, vocab: int, block: int, names: list[str]) -> dict[str, GPTConfig]:
    """The models measured: `shape` (layers x heads x width) in each architecture `names` lists."""
    n_layer, n_head, n_embd = (int(n) for n in shape.split("x"))
    fields = dict(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    every = {"GPT-2": GPTConfig(**fields), "modern": model_config(arch="modern", **fields)}
    return {name: every[name] for name in names}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What `minigpt generate --backend B --quantize Q` runs, on `threads` (None: the engine's choice)."""

    label: str
    backend: str
    quantize: str = "none"
    threads: int | None = None
    kernels: bool = True  # the NumPy engine's compiled one-token steps (False: its array path)
    kv_cache: str = "auto"  # --kv-cache: auto is float16 on the NumPy engine, the dtype on torch


SETUPS = [
    Setup("NumPy (generate's default)", "numpy"),
    Setup("NumPy, one thread", "numpy", threads=1),
    Setup("NumPy `--kv-cache float32`", "numpy", kv_cache="float32"),
    Setup("torch", "torch"),
    Setup("NumPy `--quantize int8` (generate's default for it)", "numpy", "int8"),
    Setup("torch `--quantize int8`", "torch", "int8"),
    Setup("NumPy array path (no kernels)", "numpy", kernels=False),
]
E2E: list[tuple[str, tuple[str, ...], dict[str, str]]] = [  # (what, extra options, environment)
    ("`minigpt generate` (auto: the NumPy engine, its own threads)", (), {}),
    ("the same with `OPENBLAS_NUM_THREADS=1`", (), {"OPENBLAS_NUM_THREADS": "1"}),
    ("`minigpt generate --backend torch`", ("--backend", "torch"), {}),
    ("`minigpt generate --quantize int8` (the NumPy engine)", ("--quantize", "int8"), {}),
    ("`minigpt generate --quantize int8 --backend torch`", ("--quantize", "int8", "--backend", "torch"), {}),
]


def tokenizer(vocab: int) -> CharTokenizer:
    """tinyshakespeare's 65 characters (where they are the vocabulary and the file is here), else `vocab`
    characters of no text: decoding speed does not depend on what the tokens spell."""
    if vocab == 65 and SHAKESPEARE.is_file():
        return CharTokenizer.from_text(SHAKESPEARE.read_text(encoding="utf-8"))
    return CharTokenizer(["\n"] + [chr(32 + i) for i in range(vocab - 1)])


# --- the bound ------------------------------------------------------------------------------------------


def engine_bytes(engine: Any) -> int:
    """Bytes of weights a one-token step of `engine` reads (`step_bytes`), with the head it decodes with
    (the NumPy engine's may be int8 where its weight tree's is the float32 table)."""
    head = getattr(engine, "_head", None)
    tree = engine.weights if head is None else dataclasses.replace(engine.weights, lm_head=head)
    return step_bytes(tree)


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


def timed(engine: Engine, tok: Tokenizer, n: int, batch: int) -> tuple[float, float, int]:
    """(aggregate tokens/s, time to first token, threads of the last step) of `batch` samples of n tokens,
    as `minigpt generate` runs them."""
    gen = Generation(
        engine, tok, encode_prompt(tok, ""), max_new_tokens=n, num_samples=batch, temperature=1.0, seed=0
    )
    gen.run()
    return gen.tokens_per_second, gen.time_to_first_token, engine.threads


NUMPY_TIMING = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from minigpt.generate.decode import Generation, encode_prompt
from minigpt.generate.load import load_engine
threads = None if sys.argv[5] == "auto" else int(sys.argv[5])
engine, tok = load_engine(Path(sys.argv[2]), "numpy", quantize=sys.argv[7], threads=threads, kv_cache=sys.argv[8])
if sys.argv[6] == "off":  # the array path: the same run, the same weights, no compiled steps
    from minigpt.generate.engines.numpy_engine import NumpyEngine
    from minigpt.runs.folder import RunDir
    run = RunDir(Path(sys.argv[2]))
    config = run.open()[1]
    engine = NumpyEngine(config, run.load_weights(config, framework="np"), layout="auto", threads=threads,
                         kernels=False, kv_cache=engine.kv_cache)
n, batches = int(sys.argv[3]), json.loads(sys.argv[4])
out = []
for batch in batches:
    gen = Generation(engine, tok, encode_prompt(tok, ""), max_new_tokens=n, num_samples=batch, seed=0,
                     temperature=1.0)
    gen.run()
    out.append([gen.tokens_per_second, gen.time_to_first_token, engine.threads])
layout = engine.layout
if engine.kernels and engine._head.weight.ndim == 4:  # int8: every matrix, the head's too, as int8 bands
    layout += ", every matrix as int8 bands"
elif engine.kernels:  # the batched steps' form and the prefills' products the engine measured (README: "Generation")
    if engine.bands:  # the blocks' matrices as bands; the head by rows or tiles, as measured
        layout += ", blocks as bands, the head"
    layout += ", " + "; ".join(
        f"{rows} rows: " + ("rows" if t is None else f"tiles from {t}") for rows, t in engine.tiles.items()
    )
if engine.kernels and engine.bands and engine.quantize == "none":  # the prefetch distances measured per batch
    from minigpt.generate.engines.numpy_engine import prefetch_label
    layout += "; bands ask ahead " + ", ".join(f"{rows} rows: {prefetch_label(a)}" for rows, a in engine.prefetch.items())
if engine.kernels:
    layout += "; every prefill by the kernels" if engine.bands else f"; prefill kernels to {engine.kernel_rows} rows"
print(json.dumps({"results": out, "layout": layout}), "torch" in sys.modules)
"""


def numpy_round(
    run_dir: Path,
    n: int,
    batches: list[int],
    threads: int | None,
    kernels: bool = True,
    quantize: str = "none",
    kv_cache: str = "auto",
) -> tuple[list[Any], str]:
    """One round of the NumPy engine over every batch size, in a process of its own as `minigpt generate`
    runs it: no torch loaded, whose idle OpenMP threads would otherwise share the cores. Returns each
    batch's (tokens/s, first token, threads) and the layout the engine chose."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    args = [str(ROOT), str(run_dir), str(n), json.dumps(batches), str(threads or "auto")]
    args += ["on" if kernels else "off", quantize, kv_cache]
    out = subprocess.run(
        [sys.executable, "-c", NUMPY_TIMING, *args], check=True, capture_output=True, text=True, env=env
    ).stdout.rsplit(" ", 1)
    if out[-1].strip() != "False":
        raise SystemExit("the NumPy engine imported torch")
    data = json.loads(out[0])
    return data["results"], data["layout"]


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


def end_to_end(run_dir: Path, n: int, *extra: str, env: dict[str, str], code: Path = ROOT) -> float:
    """Wall seconds of `python -m minigpt generate` as a user runs it: start-up, loading, generation
    (`code`: the checkout whose minigpt runs; `python -m` imports it from the working directory)."""
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
    # a user's shell sets none of these; without PYTHONDONTWRITEBYTECODE (this sandbox sets it) Python
    # reads the package's compiled bytecode, written by the untimed first run, as on a user's machine
    clean = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "PYTHONDONTWRITEBYTECODE")
    run_env = {k: v for k, v in os.environ.items() if k not in clean}
    t0 = time.perf_counter()
    subprocess.run([*cmd, *extra], cwd=code, check=True, capture_output=True, env={**run_env, **env})
    return time.perf_counter() - t0


def end_to_end_table(run_dir: Path, n: int, runs: int, against: Path | None) -> None:
    """The end-to-end rows, round robin; with `against`, that checkout's default command too, and the
    median over rounds of its time over this checkout's."""
    variants = [(what, extra, env, ROOT) for what, extra, env in E2E]
    if against is not None:
        variants.insert(1, (f"the same, the code at {against}", (), {}, against))
    for _, extra, env, code in variants:  # untimed: numba compiles a new checkout's kernels once
        end_to_end(run_dir, 5, *extra, env=env, code=code)
    times: dict[str, list[float]] = {what: [] for what, *_ in variants}
    for _ in range(runs):
        for what, extra, env, code in variants:
            times[what].append(end_to_end(run_dir, n, *extra, env=env, code=code))
    for what, each in times.items():
        print(
            f"| {what} | {statistics.median(each):.2f} s | {', '.join(f'{t:.2f}' for t in each)} |",
            flush=True,
        )
    if against is not None:
        here, there = times[variants[0][0]], times[variants[1][0]]
        ratio = statistics.median(b / a for a, b in zip(here, there, strict=True))
        print(
            f"\nthe code at {against} over this checkout, end to end (median of {runs} rounds' ratios): {ratio:.3f}x"
        )


def import_torch_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


# --- the measurements -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    arch: str
    setup: Setup
    bytes_per_step: int = 0
    layout: str = ""
    speeds: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # batch -> tokens/s per repeat
    threads: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # batch -> threads chosen
    first_token: list[float] = dataclasses.field(default_factory=list)  # seconds, batch 1

    def median(self, batch: int) -> float:
        return statistics.median(self.speeds[batch])

    def add(self, batch: int, tps: float, ttft: float, threads: int) -> None:
        self.speeds.setdefault(batch, []).append(tps)
        self.threads.setdefault(batch, []).append(threads)
        if batch == 1:
            self.first_token.append(ttft)


def paired(top: Row, top_batch: int, bottom: Row, bottom_batch: int) -> float:
    """The median over rounds of `top`'s tokens/s over `bottom`'s in the same round: both measured within
    the round's minute, so the machine's drift from one round to the next cancels in each ratio."""
    pairs = zip(top.speeds[top_batch], bottom.speeds[bottom_batch], strict=True)
    return statistics.median(a / b for a, b in pairs)


def measure(
    runs: dict[str, Path], tok: Tokenizer, n: int, batches: list[int], repeats: int
) -> tuple[list[Row], dict[int, list[float]]]:
    """Every setup of every architecture at every batch size, round-robin, `repeats` times, with the
    bandwidth on one thread and on every core measured before each round; (rows, {threads: bandwidths})."""
    rows = [Row(arch, setup) for arch in runs for setup in SETUPS]
    engines: dict[tuple[str, str], Engine] = {}
    for row in rows:
        setup = row.setup
        engine, _ = load_engine(
            runs[row.arch], setup.backend, "cpu", "float32", setup.quantize, setup.threads, setup.kv_cache
        )
        row.bytes_per_step = engine_bytes(engine)
        row.layout = engine.layout  # type: ignore[attr-defined]
        if setup.backend == "torch":  # the NumPy engine is timed in processes of its own
            engines[(row.arch, setup.label)] = engine
    bandwidths: dict[int, list[float]] = {n: [] for n in sorted({1, os.cpu_count() or 1})}
    for _ in range(repeats):
        for threads, each in bandwidths.items():
            each.append(stream_read(threads))
        for row in rows:
            if row.setup.backend == "numpy":
                setup = row.setup
                results, row.layout = numpy_round(
                    runs[row.arch], n, batches, setup.threads, setup.kernels, setup.quantize, setup.kv_cache
                )
            else:
                engine = engines[(row.arch, row.setup.label)]
                results = [timed(engine, tok, n, b) for b in batches]
            for batch, (tps, ttft, threads) in zip(batches, results, strict=True):
                row.add(batch, tps, ttft, threads)
    return rows, bandwidths


def past_the_block(
    config: GPTConfig, tok: Tokenizer, short: int, long: int, repeats: int
) -> list[tuple[str, float, float]]:
    """Batch-1 tokens/s over `short` and `long` new tokens, for a rotary model (its ring-buffer cache) and
    a learned-position one (slides and re-reads its window), on each engine, round-robin, medians."""
    engines: dict[str, Engine] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pos in ("rope", "learned"):
            run_dir = Path(tmp) / pos
            RunDir(run_dir).save(GPT(dataclasses.replace(config, pos=pos)).eval(), tok, extra={})
            for backend in ("torch", "numpy"):
                engines[f"{pos}, {backend}"], _ = load_engine(run_dir, backend, "cpu", "float32", "none")
        speeds: dict[str, dict[int, list[float]]] = {name: {short: [], long: []} for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                for n in (short, long):
                    speeds[name][n].append(timed(engine, tok, n, 1)[0])
    return [(name, statistics.median(s[short]), statistics.median(s[long])) for name, s in speeds.items()]


# --- the report -----------------------------------------------------------------------------------------


def _threads(row: Row, batch: int) -> str:
    counts = sorted(set(row.threads[batch]))
    return "/".join(str(c) for c in counts)


def bandwidth_of(row: Row, bounds: dict[int, float]) -> float:
    """The bandwidth bounding a row: on one thread for a row fixed to one, else on every core."""
    return bounds[1] if row.setup.threads == 1 else bounds[max(bounds)]


def print_rows(rows: list[Row], batches: list[int], bounds: dict[int, float]) -> None:
    heads = " | ".join(f"batch {b}" for b in batches)
    print(
        f"| model | engine | layout | threads (batch {' / '.join(map(str, batches))}) | MB read per step | {heads} | batch {batches[-1]} / batch 1 | first token |"
    )
    print(f"| --- | --- | --- | --- | ---: | {' | '.join('---:' for _ in batches)} | ---: | ---: |")
    for row in rows:
        bound = bandwidth_of(row, bounds) / row.bytes_per_step
        cells = [f"{row.median(b):,.0f} ({row.median(b) / (b * bound):.2f})" for b in batches]
        threads = " / ".join(_threads(row, b) for b in batches)
        ratio = paired(row, batches[-1], row, batches[0])
        ttft = statistics.median(row.first_token) * 1000
        print(
            f"| {row.arch} | {row.setup.label} | {row.layout} | {threads} | {row.bytes_per_step / 1e6:.1f} | "
            f"{' | '.join(cells)} | {ratio:.2f}x | {ttft:.1f} ms |"
        )


def print_targets(rows: list[Row], bounds: dict[int, float]) -> None:
    """The issues' targets, each as a ratio measured in this run."""
    archs = list(dict.fromkeys(r.arch for r in rows))
    print("\n| target | " + " | ".join(archs) + " |")
    print("| --- | " + " | ".join("---:" for _ in archs) + " |")
    by = {(r.arch, r.setup.label): r for r in rows}

    def frac(arch: str, label: str) -> float:
        row = by[(arch, label)]
        return row.median(1) / (bandwidth_of(row, bounds) / row.bytes_per_step)

    lines = {
        "NumPy batch 1, generate's threads, of the bound (>= 0.7)": lambda a: frac(a, SETUPS[0].label),
        "NumPy batch 1, one thread, of the bound (>= 0.6)": lambda a: frac(a, SETUPS[1].label),
        "NumPy batch 8 / batch 1, generate's threads (>= 4)": lambda a: paired(
            by[(a, SETUPS[0].label)], 8, by[(a, SETUPS[0].label)], 1
        ),
        "int8 (NumPy) batch 1 / NumPy float32 batch 1 (>= 2)": lambda a: paired(
            by[(a, SETUPS[4].label)], 1, by[(a, SETUPS[0].label)], 1
        ),
        "torch int8 batch 1 / torch float32 batch 1": lambda a: paired(
            by[(a, SETUPS[5].label)], 1, by[(a, SETUPS[3].label)], 1
        ),
        "NumPy batch 8, float16 KV cache / float32": lambda a: paired(
            by[(a, SETUPS[0].label)], 8, by[(a, SETUPS[2].label)], 8
        ),
    }
    if 8 not in rows[0].speeds:  # --batches without 8
        del lines["NumPy batch 8 / batch 1, generate's threads (>= 4)"]
        del lines["NumPy batch 8, float16 KV cache / float32"]
    for what, value in lines.items():
        print(f"| {what} | " + " | ".join(f"{value(a):.2f}" for a in archs) + " |")


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="6x6x384", help="layers x heads x width (default 6x6x384)")
    ap.add_argument("--vocab", type=int, default=65, help="vocabulary size (default 65: tinyshakespeare's)")
    ap.add_argument("--block", type=int, default=256, help="block size (default 256)")
    ap.add_argument("--archs", default="GPT-2,modern", help="architectures, comma-separated (default both)")
    ap.add_argument(
        "--tokens", type=int, default=250, help="new tokens per sample, inside the block (default 250)"
    )
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated, 1 first (default 1,8)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin repeats, median shown (default 3)")
    ap.add_argument("--e2e-tokens", type=int, default=200, help="tokens for the end-to-end run (default 200)")
    ap.add_argument(
        "--e2e-runs", type=int, default=3, help="end-to-end repetitions, median shown (default 3)"
    )
    ap.add_argument("--skip-baseline", action="store_true", help="skip the slow full-recompute loop")
    ap.add_argument(
        "--e2e-against",
        type=Path,
        help="another checkout (say `git worktree add /tmp/before HEAD~3`): its default `generate` joins the "
        "end-to-end round robin, and the median of each round's ratio is printed",
    )
    ap.add_argument(
        "--long",
        type=int,
        default=4000,
        help="new tokens for the past-the-block table (default 4000; 0 skips it)",
    )
    return ap.parse_args()


def print_bound(bandwidths: dict[int, list[float]]) -> dict[int, float]:
    """The bandwidths measured, with the caches; returns the best on each thread count."""
    print(
        f"caches: {caches_line()}; memory bandwidth (a read-only stream over {stream_bytes() / 2**20:,.0f} MiB, "
        "best of 3 passes before each round): "
        + "; ".join(
            f"{n} thread{'s' if n > 1 else ''} {', '.join(f'{b / 1e9:.1f}' for b in each)} GB/s"
            for n, each in bandwidths.items()
        )
        + " (the bound uses each count's best)\n"
    )
    return {n: max(each) for n, each in bandwidths.items()}


def main() -> None:
    args = arguments()
    batches = [int(b) for b in args.batches.split(",")]
    configs = architectures(args.shape, args.vocab, args.block, args.archs.split(","))
    config = next(iter(configs.values()))
    tok = tokenizer(args.vocab)
    load_before = load_line()
    with tempfile.TemporaryDirectory() as tmp:
        # the layouts are measured in this run (its first loads), not read from an earlier one
        os.environ["MINIGPT_CACHE_DIR"] = str(Path(tmp) / "cache")
        runs = {}
        for arch, arch_config in configs.items():
            torch.manual_seed(0)
            runs[arch] = Path(tmp) / arch
            RunDir(runs[arch]).save(GPT(arch_config).eval(), tok, extra={})
        rows, bandwidths = measure(runs, tok, args.tokens, batches, args.repeats)
        print(
            f"\n{cpu_model()}, {os.cpu_count()} CPUs; numpy {np.__version__}, torch {torch.__version__}; "
            f"{config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide, block {config.block_size}, "
            f"vocab {config.vocab_size}; {args.tokens} new tokens per sample; medians of {args.repeats} "
            f"round-robin repeats; load average {load_before} before, {load_line()} after\n"
        )
        bounds = print_bound(bandwidths)
        print("aggregate tokens/s (fraction of the bound: N x bandwidth / bytes read per step)\n")
        print_rows(rows, batches, bounds)
        print_targets(rows, bounds)
        if not args.skip_baseline:
            model = GPT(config).eval()
            print(
                f"\nfull recompute (nanoGPT's loop, float32, batch 1): {full_recompute(model, tok, args.tokens):.1f} tokens/s"
            )
        arch = next(iter(runs))
        print(
            f"\n| {args.e2e_tokens} tokens, end to end (start-up included), {arch} architecture | median of {args.e2e_runs} | each |"
        )
        print("| --- | ---: | --- |", flush=True)
        end_to_end_table(runs[arch], args.e2e_tokens, args.e2e_runs, args.e2e_against)
    print(f"| `python -c 'import torch'` alone | {import_torch_seconds():.2f} s | |")
    if args.long:
        print(
            f"\n| batch 1, past block {config.block_size} | {args.e2e_tokens} new tokens | {args.long} new tokens | ratio |"
        )
        print("| --- | ---: | ---: | ---: |", flush=True)
        for name, short, long in past_the_block(config, tok, args.e2e_tokens, args.long, args.repeats):
            print(f"| {name} | {short:,.0f} | {long:,.0f} | {long / short:.2f} |", flush=True)


if __name__ == "__main__":
    main()
