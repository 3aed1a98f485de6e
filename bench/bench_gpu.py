"""GPU benchmark: GPT-2 124M training throughput and MFU with --compile off and on, and decoding at batch 1
and 16 against the time it takes to read the weights once, with the GPU's ceilings measured in the same run.

Usage: python bench/bench_gpu.py --text FILE --tokenizer FILE.tiktoken [--out DIR] [--steps 60] [--batch 16]
[--variants eager,compiled,...]. Prints markdown tables (and writes them, kernel profiles of a few training
steps and of 20 decoding steps, and a JSON of every number under --out). The variants other than `eager` and
`compiled` undo this benchmark's fixes one at a time (VARIANTS), to measure what each bought. MFU counts FLOPs as `minigpt params` does (6N plus attention's, PaLM's accounting, as
nanoGPT counts) against the GPU's published dense bf16 peak (--peak-tflops for a GPU the table lacks), and
against the bf16 matrix rate measured here. `--device cpu --preset tiny` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minigpt.data.dataset import DataConfig  # noqa: E402
from minigpt.generate.decode import Sampling, decode  # noqa: E402
from minigpt.generate.load import load_engine  # noqa: E402
from minigpt.model import head_loss as model_module  # noqa: E402
from minigpt.model.params import count_params  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.train.loop import TrainConfig, train  # noqa: E402

# dense bf16 tensor-core peaks from the vendor's datasheets, TFLOP/s (sparsity excluded)
PEAKS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "A100": 312.0}


def published_peak(name: str) -> float | None:
    return next((v for k, v in PEAKS.items() if k in name), None)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3) -> float:
    """The median of `repeats` timed calls of fn, after `warmup` untimed ones, each fenced by a sync."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_tflops(device: str) -> float:
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / median_seconds(lambda: a @ b, device, 10) / 1e12


def _bandwidths(device: str) -> tuple[float, float]:
    """GB/s of a read-only pass (a sum) and of a copy (bytes read plus bytes written) over 4 GiB."""
    words = (1 << 30) if device == "cuda" else (1 << 24)
    x = torch.randn(words, device=device)
    y = torch.empty_like(x)
    read = median_seconds(lambda: x.sum(), device, 10)
    copy = median_seconds(lambda: y.copy_(x), device, 10)
    return 4 * words / read / 1e9, 8 * words / copy / 1e9


def ceilings(device: str) -> dict[str, float]:
    """A large bf16 matrix product's rate (random data) and the memory's read and copy bandwidths."""
    read, copy = _bandwidths(device)
    return {"bf16_matmul_tflops": _matmul_tflops(device), "read_gb_s": read, "copy_gb_s": copy}


def head_widths(device: str, rows: int, dim: int = 768) -> dict[str, float]:
    """The LM head's three bf16 products of a training step (logits, their gradients to the hidden states
    and to the weights) at GPT-2's 50,257 tokens and at 50,304 (a multiple of 128), TFLOP/s."""
    rates = {}
    for vocab in (50257, 50304):
        x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
        w = torch.randn(vocab, dim, device=device, dtype=torch.bfloat16)
        g = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16)
        seconds = median_seconds(lambda x=x, w=w, g=g: (x @ w.t(), g @ w, g.t() @ x), device, 10)
        rates[str(vocab)] = 3 * 2 * rows * dim * vocab / seconds / 1e12
    return rates


def kernel_seconds(events: Any) -> float:
    """The device's busy time in a profile: its kernels' (an operator's own device time repeats them)."""
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    return sum(e.self_device_time_total for e in kernels) / 1e6


class KernelProfile:
    """torch's profiler over a few training steps (from the `on_step` hook): the kernels that took the
    device's time, and how much of the steps' wall time the device was busy."""

    def __init__(self, device: str, first: int, steps: int) -> None:
        self.device, self.first, self.last = device, first, first + steps
        self.prof: Any = None
        self.start = 0.0
        self.wall = 0.0

    def __call__(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if step == self.first:
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.start = time.perf_counter()
        elif step == self.last and self.prof is not None:
            sync(self.device)
            self.wall = time.perf_counter() - self.start
            self.prof.__exit__(None, None, None)

    def table(self) -> str:
        if self.prof is None:
            return "(no profile)"
        key = "device_time_total" if self.device == "cuda" else "cpu_time_total"
        events = self.prof.key_averages()
        kernels = kernel_seconds(events)
        head = f"{self.last - self.first} steps, {self.wall:.3f} s wall, device busy {kernels:.3f} s\n"
        return head + events.table(sort_by=key, row_limit=25, max_name_column_width=70)


def _train_cfg(args: argparse.Namespace, compiled: bool, steps: int) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, arch="gpt2", batch_size=args.batch, max_iters=steps, eval_every=10**9,
        eval_iters=1, log_every=1, warmup=10, device=args.device, compile=compiled,
    )  # fmt: skip


# how training ran before each fix (README: "GPU"): the head's loss over chunks of 16 MB of logits, and on
# GPT-2's unpadded 50,257 rows; each variant: (compiled, head chunk elements, head row multiple)
VARIANTS = {
    "eager": (False, None, None),
    "eager-unpadded": (False, None, 1),
    "eager-unpadded-small-chunks": (False, model_module.HEAD_LOSS_ELEMENTS, 1),
    "compiled": (True, None, None),
    "compiled-unpadded": (True, None, 1),
}


def train_rate(args: argparse.Namespace, variant: str, out: Path, profile: KernelProfile | None) -> dict:
    """Steady tokens/s of `minigpt train`'s own loop (its step log, the first third of the steps left
    out: compilation and warm-up), the whole call's seconds and the device's peak memory."""
    compiled, chunk, multiple = VARIANTS[variant]
    saved = model_module.ACCELERATOR_HEAD_LOSS_ELEMENTS, model_module.ACCELERATOR_HEAD_ROW_MULTIPLE
    model_module.ACCELERATOR_HEAD_LOSS_ELEMENTS = chunk or saved[0]
    model_module.ACCELERATOR_HEAD_ROW_MULTIPLE = multiple or saved[1]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    steps = args.steps if chunk is None else max(12, args.steps // 2)  # the slowest variant: fewer steps
    data = DataConfig(paths=(args.text,), cache_dir=out.parent / "cache", tokenizer=str(args.tokenizer))
    start = time.perf_counter()
    try:
        result = train(_train_cfg(args, compiled, steps), data, out=out, overwrite=True, on_step=profile)
    finally:
        model_module.ACCELERATOR_HEAD_LOSS_ELEMENTS, model_module.ACCELERATOR_HEAD_ROW_MULTIPLE = saved
    whole = time.perf_counter() - start
    logged = [r for r in result.metrics if r["kind"] == "train"]
    first = next(r for r in logged if r["step"] >= steps // 3)
    last = logged[-1]
    rate = (last["tokens"] - first["tokens"]) / (last["elapsed"] - first["elapsed"])
    flops = count_params(RunDir(out).model_config()).flops_per_token["training"]
    stats = dict(torch._dynamo.utils.counters["stats"]) if compiled else {}
    return {
        "variant": variant,
        "tokens_per_s": rate,
        "step_ms": 1e3 * (last["elapsed"] - first["elapsed"]) / (last["step"] - first["step"]),
        "flops_per_token": flops,
        "tflops": rate * flops / 1e12,
        "first_step_s": logged[0]["elapsed"],
        "whole_s": whole,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else 0.0,
        "dynamo": {k: int(v) for k, v in stats.items()},
        "final_loss": last["loss"],
    }


def decode_rate(run: Path, device: str, dtype: str, rows: int, tokens: int, repeats: int) -> dict:
    """Tokens/s of the torch engine's decode loop (the one `minigpt generate` runs: prefill, then one
    KV-cached step per token, sampling included), `rows` samples of `tokens` each; the median of `repeats`."""
    engine, tokenizer = load_engine(run, "torch", device=device, dtype=dtype)
    prompt = tokenizer.encode("ROMEO:")

    def once() -> None:
        for _ in decode(engine, [prompt], tokens, num_samples=rows, sampling=Sampling(temperature=1.0)):
            pass

    seconds = median_seconds(once, device, repeats, warmup=1)
    config = engine.model.config
    report = count_params(config)
    lookups = config.block_size * config.n_embd if config.pos == "learned" else 0
    weight_bytes = (report.exact_total - lookups) * torch.finfo(getattr(torch, engine.dtype)).bits // 8
    return {
        "dtype": engine.dtype,
        "rows": rows,
        "tokens_per_s": rows * tokens / seconds,
        "step_us": 1e6 * seconds / tokens,
        "weight_bytes": weight_bytes,
    }


def decode_profile(run: Path, device: str, steps: int = 20) -> str:
    """torch's profiler over `steps` batch-1 decoding steps (bf16 on a GPU): the host's operations and the
    device's kernels, against the wall time."""
    engine, tokenizer = load_engine(run, "torch", device=device)
    prompt = tokenizer.encode("ROMEO:")
    for _ in decode(engine, [prompt], 8, sampling=Sampling(temperature=1.0)):
        pass
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in decode(engine, [prompt], steps, sampling=Sampling(temperature=1.0)):
            pass
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = kernel_seconds(events)
    launches = sum(e.count for e in events if e.key.startswith("aten::"))
    head = (
        f"{steps} steps (+ a prefill), {wall:.4f} s wall, device busy {busy:.4f} s, {launches} aten calls\n"
    )
    key = "device_time_total" if device == "cuda" else "cpu_time_total"
    return head + events.table(sort_by=key, row_limit=25, max_name_column_width=70)


def environment(device: str) -> dict[str, str]:
    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
        found["cuda"] = str(torch.version.cuda)
        smi = ["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        try:
            found["nvidia-smi"] = subprocess.run(
                smi, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except OSError:
            found["nvidia-smi"] = "(absent)"
    return found


def markdown(env: dict, ceil: dict, peak: float | None, training: list[dict], decoding: list[dict]) -> str:
    lines = [" ".join(f"{k}: {v};" for k, v in env.items())]
    lines.append(
        f"measured: bf16 matrix product {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, read {ceil['read_gb_s']:.0f} GB/s, "
        f"copy {ceil['copy_gb_s']:.0f} GB/s; published dense bf16 peak: {peak or 'unknown'} TFLOP/s"
    )
    lines += [
        "",
        "| training | tokens/s | step ms | TFLOP/s | MFU (published) | of measured | first step s | whole s | peak GB |",
    ]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in training:
        mfu = f"{100 * r['tflops'] / peak:.1f}%" if peak else "-"
        label = r["variant"]
        lines.append(
            f"| {label} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['tflops']:.1f} | {mfu} | "
            f"{100 * r['tflops'] / ceil['bf16_matmul_tflops']:.1f}% | {r['first_step_s']:.1f} | {r['whole_s']:.1f} | "
            f"{r['peak_memory_gb']:.1f} |"
        )
    lines += ["", "| decoding | rows | tokens/s | µs per step | weights MB | read once µs | step / read |"]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in decoding:
        read_us = r["weight_bytes"] / (ceil["read_gb_s"] * 1e9) * 1e6
        lines.append(
            f"| {r['dtype']} | {r['rows']} | {r['tokens_per_s']:,.0f} | {r['step_us']:.0f} | "
            f"{r['weight_bytes'] / 1e6:.0f} | {read_us:.0f} | {r['step_us'] / read_us:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--tokenizer", default="r50k_base", help="a tokenizer name or .tiktoken file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--decode-tokens", type=int, default=256, help="0: no decoding")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--profile", default="eager,compiled", help="the variants to profile 5 steps of")
    parser.add_argument(
        "--variants", default="eager,compiled", help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device)
    peak = args.peak_tflops or (published_peak(env.get("gpu", "")) if args.device == "cuda" else None)
    ceil = ceilings(args.device)
    heads = head_widths(args.device, rows=8192 if args.device == "cuda" else 256)
    print(json.dumps({**env, **ceil, "head_tflops": heads}), flush=True)
    work = Path(tempfile.mkdtemp())
    training = []
    for variant in args.variants.split(","):
        profiled = variant in args.profile.split(",")
        profile = KernelProfile(args.device, first=args.steps - 8, steps=5) if profiled else None
        training.append(train_rate(args, variant, work / variant, profile))
        print(json.dumps(training[-1]), flush=True)
        if profile is not None:
            (out / f"profile_{variant}.txt").write_text(profile.table())
    decoding = []
    run = next((work / n for n in VARIANTS if (work / n / RunDir.WEIGHTS).exists()), None)
    if args.decode_tokens and run is not None:
        for dtype in ("bfloat16", "float32"):
            for rows in (1, 16):
                decoding.append(decode_rate(run, args.device, dtype, rows, args.decode_tokens, repeats=3))
                print(json.dumps(decoding[-1]), flush=True)
        (out / "profile_decode.txt").write_text(decode_profile(run, args.device))
    table = markdown(env, ceil, peak, training, decoding)
    (out / "bench_gpu.md").write_text(table + "\n")
    (out / "bench_gpu.json").write_text(
        json.dumps(
            {"env": env, "ceilings": ceil, "head_tflops": heads, "training": training, "decoding": decoding},
            indent=1,
        )
    )
    print(table)


if __name__ == "__main__":
    main()
