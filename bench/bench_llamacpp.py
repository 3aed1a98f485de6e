"""minigpt against llama.cpp: batch-1 decoding of the same weights, in the same dtype, on the same threads.

Not part of CI: it needs llama.cpp's binaries (`--bin DIR`, or the environment's LLAMA_CPP_BIN;
`../shared/tools/llama.cpp/bin` here is a generic build, one for this CPU, `GGML_NATIVE=ON`, is the fairer
opponent) and a GGUF of a minigpt run. Both sides run as whole commands, as a user runs them, round robin,
`--repeats` times, with the same prompt, length and seed, on each thread count (OMP_NUM_THREADS and
OPENBLAS_NUM_THREADS for minigpt, -t for llama.cpp; `auto`: each its own choice). Compared: tokens/s over
the generation (prompt, decoding and sampling, start-up and loading left out: llama.cpp's own timings, and
`minigpt generate --json`'s), and the whole command's wall time.
float32 races the f32 GGUF; int8 (`--quantize int8`) races the q8_0 one where `--dtypes` names it.

Each round also measures the memory bound on each thread count (bench/bandwidth.py: a read-only stream
over four times the last-level cache, read from the machine), and the table gives each side's float32
tokens/s as a fraction of (bandwidth / bytes a step reads), and, with `--batch N`, minigpt's aggregate
tokens/s over N samples (`--num-samples N`, its own threads) against one.

    # one command: a random GPT-2-124M-shaped model (r50k's 50,257 tokens, block 1024), its f32 and q8_0
    # GGUFs (`minigpt convert to-gguf`, made once in --work), the race at 1 and 2 threads in both dtypes,
    # batch 8, the bound, and the issue's targets as a markdown table
    python bench/bench_llamacpp.py --work /tmp/gpt2-race --shape 12x12x768 --vocab r50k --block 1024 \\
        --bin /work/llamacpp/native --dtypes f32,q8_0 --threads 1,2 --batch 8 --tokens 128

    # the 6x6x384 race of the results page: a run with the default tokenizer's 512 BPE tokens
    python bench/bench_llamacpp.py --make-run /tmp/run --arch gpt2
    minigpt convert to-gguf /tmp/run /tmp/run.f32.gguf
    python bench/bench_llamacpp.py --bin ../shared/tools/llama.cpp/bin --gguf /tmp/run.f32.gguf --run /tmp/run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bandwidth import caches_line, cpu_model, load_line, stream_bytes, stream_read

ROOT = Path(__file__).resolve().parent.parent
R50K = ROOT.parent / "shared" / "data" / "r50k_base.tiktoken"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
PROMPT = "ROMEO:"
QUANTIZE = {"f32": "none", "q8_0": "int8"}  # a GGUF's dtype -> what minigpt decodes the same weights in


def make_run(out: Path, arch: str, vocab: str, shape: str = "6x6x384", block: int = 256) -> None:
    """A model of `shape` (layers x heads x width; default 6x6x384, block 256) with random weights and 512
    BPE tokens learned from tinyshakespeare (`vocab` bpe512: the default tokenizer's size, so that, as in
    the char model of bench_generate, the blocks are what a step reads) or GPT-2's tokenizer (r50k: its
    50,257-token head is a large share of a step)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.model.presets import model_config
    from minigpt.runs.folder import RunDir
    from minigpt.tokenizer.bpe import BPETokenizer, TiktokenTokenizer

    if vocab == "r50k":
        tok = TiktokenTokenizer.from_file(R50K)
    else:
        tok = BPETokenizer.train([SHAKESPEARE.read_text(encoding="utf-8")], vocab_size=512)
    n_layer, n_head, n_embd = (int(n) for n in shape.split("x"))
    config = model_config(
        arch=arch, vocab_size=tok.vocab_size, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():  # both sides run every token: no <|endoftext|> ends a sample early (llama.cpp
        # would ignore it, minigpt stops there), so its head row is 0 and every other logit 20x wider
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[tok.eot_id] = 0.0
    RunDir(out).save(model, tok, extra={})
    print(f"wrote {out}: {arch} {shape}, block {block}, vocab {tok.vocab_size}", file=sys.stderr)


def prepared(work: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Path]]:
    """The run and its GGUFs in `work` (each made by the first command that needs it): the run, then
    `minigpt convert to-gguf --dtype D` for each of `--dtypes`."""
    run = work / "run"
    if not (run / "config.json").is_file():
        make_run(run, args.arch, args.vocab, args.shape, args.block)
    ggufs = {}
    for dtype in args.dtypes.split(","):
        ggufs[dtype] = work / f"run.{dtype}.gguf"
        if not ggufs[dtype].is_file():
            cmd = [sys.executable, "-m", "minigpt", "convert", "to-gguf", str(run), str(ggufs[dtype])]
            subprocess.run([*cmd, "--dtype", dtype], check=True, cwd=ROOT, env=clean_env(None))
    return run, ggufs


def clean_env(threads: int | None) -> dict[str, str]:
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return {**env, "PYTHONPATH": str(ROOT)}


def llama(binary: Path, gguf: Path, n: int, threads: int | None, seed: int) -> tuple[float, float]:
    """(tokens/s over prompt, decoding and sampling; wall seconds) of one llama-completion run."""
    cmd = [str(binary), "-m", str(gguf), "-p", PROMPT, "-n", str(n), "--temp", "1", "--seed", str(seed),
           "--ignore-eos", "-no-cnv"]  # fmt: skip
    if threads is not None:
        cmd += ["-t", str(threads)]
    for _ in range(5):  # its log is written by a thread of its own, which loses the last lines now and then
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", check=True, env=clean_env(None)
        )
        wall = time.perf_counter() - t0
        names = ("sampling time", "prompt eval time", "eval time")
        found = [re.search(rf"perf_print:\s+{name} =\s+([0-9.]+) ms", proc.stderr) for name in names]
        if all(found):
            return n / (sum(float(f.group(1)) for f in found if f) / 1000), wall
    raise SystemExit(f"llama-completion printed no timings five times:\n{proc.stderr[-2000:]}")


def minigpt(
    run: Path, n: int, threads: int | None, seed: int, quantize: str = "none", samples: int = 1
) -> tuple[float, float]:
    """(aggregate tokens/s of the generation as `minigpt generate --json` reports it; wall seconds)."""
    cmd = [sys.executable, "-m", "minigpt", "generate", PROMPT, "-m", str(run), "-n", str(n), "--seed", str(seed),
           "--json", "--quantize", quantize, "--num-samples", str(samples)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=clean_env(threads), cwd=ROOT)
    wall = time.perf_counter() - t0
    data = json.loads(proc.stdout)
    if any(s["completion_tokens"] != n for s in data["samples"]):
        raise SystemExit(f"minigpt stopped early: {data['samples']}")
    return data["tokens_per_second"], wall


def step_bytes(run: Path) -> int:
    """Bytes of float32 weights a one-token step reads: every tensor of the run's weights file, but one row
    of the position table and, where the head is a tensor of its own, of the token table."""
    from safetensors import safe_open

    total = 0
    with safe_open(run / "model.safetensors", "np") as f:
        names = set(f.keys())
        for name in names:
            shape = f.get_slice(name).get_shape()
            size = 4 * math.prod(shape)
            one_row = name.endswith("wpe.weight") or (
                name.endswith("wte.weight") and "lm_head.weight" in names
            )
            total += 4 * shape[-1] if one_row else size
    return total


@dataclasses.dataclass
class Race:
    """Every measurement of one run: (side, dtype, threads, samples) -> [(tokens/s, wall)], and the
    bandwidth of each thread count, once a round."""

    times: dict[tuple[str, str, int | None, int], list[tuple[float, float]]] = dataclasses.field(
        default_factory=dict
    )
    bandwidth: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, key: tuple[str, str, int | None, int], value: tuple[float, float]) -> None:
        self.times.setdefault(key, []).append(value)

    def speed(self, side: str, dtype: str, threads: int | None, samples: int = 1) -> float:
        return statistics.median(t for t, _ in self.times[(side, dtype, threads, samples)])

    def wall(self, side: str, dtype: str, threads: int | None) -> float:
        return statistics.median(w for _, w in self.times[(side, dtype, threads, 1)])


def race(
    binary: Path, run: Path, ggufs: dict[str, Path], counts: list[int | None], args: argparse.Namespace
) -> Race:
    """Round robin, `--repeats` times: the bound on each thread count, then each dtype on each count,
    llama.cpp then minigpt, then minigpt's batch of `--batch` samples against one on its own threads."""
    result = Race()
    for repeat in range(args.repeats):
        for threads in sorted({t or os.cpu_count() or 1 for t in counts}):
            result.bandwidth.setdefault(threads, []).append(stream_read(threads))
        for dtype, gguf in ggufs.items():
            for threads in counts:
                result.add(
                    ("llama.cpp", dtype, threads, 1), llama(binary, gguf, args.tokens, threads, repeat)
                )
                result.add(
                    ("minigpt", dtype, threads, 1),
                    minigpt(run, args.tokens, threads, repeat, QUANTIZE[dtype]),
                )
            for samples in (1, args.batch) if args.batch else ():
                result.add(
                    ("minigpt", dtype, None, samples),
                    minigpt(run, args.tokens, None, repeat, QUANTIZE[dtype], samples),
                )
    return result


def print_race(result: Race, ggufs: dict[str, Path], counts: list[int | None]) -> None:
    print(
        "| dtype | threads | llama.cpp tokens/s | minigpt tokens/s | minigpt / llama.cpp | llama.cpp command | minigpt command |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in ggufs:
        ours = "float32" if dtype == "f32" else "`--quantize int8`"
        for threads in counts:
            speed = [result.speed(side, dtype, threads) for side in ("llama.cpp", "minigpt")]
            wall = [result.wall(side, dtype, threads) for side in ("llama.cpp", "minigpt")]
            label = "each its own" if threads is None else str(threads)
            print(
                f"| {dtype} / {ours} | {label} | {speed[0]:,.1f} | {speed[1]:,.1f} | {speed[1] / speed[0]:.2f}x | "
                f"{wall[0]:.2f} s | {wall[1]:.2f} s |"
            )


def print_targets(
    result: Race, run: Path, ggufs: dict[str, Path], counts: list[int | None], batch: int
) -> None:
    """The issue's targets as measured in this run, each with its threshold and whether it is met."""
    nbytes = step_bytes(run)
    fixed = [t for t in counts if t is not None]
    lines: list[tuple[str, float, str]] = []
    for threads in fixed:
        lines.append(
            (
                f"float32, {threads} thread(s): minigpt / llama.cpp f32",
                _ratio(result, "f32", threads),
                ">= 1.1",
            )
        )
        if "q8_0" in ggufs:
            lines.append(
                (
                    f"int8, {threads} thread(s): minigpt / llama.cpp q8_0",
                    _ratio(result, "q8_0", threads),
                    ">= 1.0",
                )
            )
    if len(fixed) > 1:
        one, most = fixed[0], fixed[-1]
        for side in ("minigpt", "llama.cpp"):
            for dtype in ggufs:
                scale = result.speed(side, dtype, most) / result.speed(side, dtype, one)
                lines.append(
                    (f"{side} {dtype}: {most} threads / {one}", scale, ">= 1.6" if side == "minigpt" else "")
                )
    if "q8_0" in ggufs:
        for threads in fixed:
            gain = result.speed("minigpt", "q8_0", threads) / result.speed("minigpt", "f32", threads)
            lines.append((f"minigpt int8 / its float32, {threads} thread(s)", gain, ">= 3"))
    for threads in fixed:
        bound = max(result.bandwidth[threads]) / nbytes
        for side in ("minigpt", "llama.cpp"):
            fraction = result.speed(side, "f32", threads) / bound
            lines.append(
                (
                    f"{side} float32, {threads} thread(s), of the bound ({bound:.1f} tokens/s)",
                    fraction,
                    ">= 0.85" if side == "minigpt" else "(> 0.9: the 1.1x is 'level')",
                )
            )
    for dtype in ggufs if batch else ():
        aggregate = result.speed("minigpt", dtype, None, batch) / result.speed("minigpt", dtype, None, 1)
        lines.append(
            (f"minigpt {dtype}: batch {batch} aggregate / batch 1 (its own threads)", aggregate, ">= 4")
        )
    print("\n| target | measured | wanted | met |")
    print("| --- | ---: | --- | --- |")
    for what, value, wanted in lines:
        met = "" if not wanted.startswith(">=") else ("yes" if value >= float(wanted[2:]) else "**no**")
        print(f"| {what} | {value:.2f} | {wanted} | {met} |")


def _ratio(result: Race, dtype: str, threads: int) -> float:
    return result.speed("minigpt", dtype, threads) / result.speed("llama.cpp", dtype, threads)


def versions(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    llama_version = (proc.stdout + proc.stderr).strip().splitlines()
    import numpy

    return f"llama.cpp {' '.join(llama_version[:1]) or 'unknown'}; numpy {numpy.__version__}"


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-run", type=Path, help="write a random model here and stop")
    ap.add_argument("--work", type=Path, help="make the run and its GGUFs here (once), then race them")
    ap.add_argument("--arch", default="gpt2", choices=("gpt2", "modern"), help="the model's architecture")
    ap.add_argument("--vocab", default="bpe512", choices=("bpe512", "r50k"), help="the model's vocabulary")
    ap.add_argument("--shape", default="6x6x384", help="the model's layers x heads x width (default 6x6x384)")
    ap.add_argument("--block", type=int, default=256, help="the model's block size (default 256)")
    ap.add_argument("--dtypes", default="f32", help="GGUF dtypes raced (--work): f32, q8_0 (int8) or both")
    ap.add_argument(
        "--bin",
        type=Path,
        default=os.environ.get("LLAMA_CPP_BIN") or None,
        help="llama.cpp's bin directory holding llama-completion (default: $LLAMA_CPP_BIN)",
    )
    ap.add_argument("--gguf", type=Path, help="the f32 GGUF of --run's weights")
    ap.add_argument("--run", type=Path, help="the minigpt run directory")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per run (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin repeats, medians shown (default 3)")
    ap.add_argument("--threads", default="1,2,auto", help="thread counts; auto: each side's own choice")
    ap.add_argument("--batch", type=int, default=0, help="also time minigpt's batch of this many samples")
    return ap.parse_args()


def main() -> None:
    args = arguments()
    if args.make_run:
        make_run(args.make_run, args.arch, args.vocab, args.shape, args.block)
        return
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        run, ggufs = prepared(args.work, args)
    elif args.bin and args.gguf and args.run:
        run, ggufs = args.run, {"f32": args.gguf}
    else:
        raise SystemExit("give --work, or --gguf and --run (or --make-run), with --bin or LLAMA_CPP_BIN")
    if not args.bin:
        raise SystemExit("give --bin (or set LLAMA_CPP_BIN): llama.cpp's bin directory")
    binary = args.bin / "llama-completion"
    counts = [None if t == "auto" else int(t) for t in args.threads.split(",")]
    load_before = load_line()
    result = race(binary, run, ggufs, counts, args)
    print(
        f"\n{run} against {', '.join(g.name for g in ggufs.values())}: {args.tokens} tokens after {PROMPT!r}, "
        f"medians of {args.repeats} round-robin repeats; {versions(binary)}; {cpu_model()}, {os.cpu_count()} "
        f"CPUs; caches: {caches_line()}; load average {load_before} before, {load_line()} after\n"
    )
    print(
        f"memory bandwidth (a read-only stream over {stream_bytes() / 2**20:,.0f} MiB, once a round): "
        + "; ".join(
            f"{n} thread(s) {', '.join(f'{b / 1e9:.1f}' for b in each)} GB/s"
            for n, each in result.bandwidth.items()
        )
        + f"; a float32 step reads {step_bytes(run) / 1e6:,.1f} MB\n"
    )
    print_race(result, ggufs, counts)
    print_targets(result, run, ggufs, counts, args.batch)


if __name__ == "__main__":
    main()
