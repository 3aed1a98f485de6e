"""What `minigpt train` measures on this machine, and what each choice buys, in one table: your machine's.

    python bench/bench_cpu_choices.py                # the choices, and the trainer against a plain loop
    python bench/bench_cpu_choices.py --busy 75s     # the same programs with one core taken by another
    python bench/bench_cpu_choices.py --only evaluations   # the choices, then the evaluations' table alone

Choices: one short `minigpt train` per shape, in a fresh cache, makes every measurement a first run on a
machine makes (the autocast dtype, Muon's and attention's, the OpenMP spin) and they are printed with their timings; the
later commands read them from that cache, as a user's second run does. Those short runs measure however
busy the machine is (MINIGPT_MEASURE=on: a load average still high from an earlier benchmark would
otherwise stop them), after waiting up to two minutes for the load to settle: run this on a quiet machine.

Ratios: whole commands timed from outside, each at two step counts, so that start-up, tokenizing and the
final evaluation cancel: tokens/s = (long - short steps) x batch x block / (t_long - t_short). The plain
PyTorch loop (bench_overhead.py's: GPT-2 written as a user writes it, nn.Linear, scaled_dot_product_attention
and cross_entropy, fused AdamW, float32, torch's default threads and OpenMP settings, no evaluation) is the
base; the same loop over minigpt's GPT module shows what the trainer itself costs apart from its model; then
`minigpt train` with the same architecture and optimizer (and --eval-iters 2), first with the choices it
measured, then with each forced the other way: the other autocast dtype (--dtype), under bf16 the other
attention dtype (--attention-dtype: float32 or bf16 products), the other spin (GOMP_SPINCOUNT). Rows and repeats interleaved, medians, the load average beside each figure. --scale 0.2
takes a fifth of the steps: a quick, rough look.

Evaluations: the same shapes' evaluation (--eval-iters 50: 50 batches of windows on each split) in
forward passes of the batch size (the CPU's default), of 256 (the rule before) and of four batches, each
the difference of whole commands at --eval-iters 50 and 1.

--busy T: `taskset -c 0 python -c "while True: pass"` holds one core while each program trains for T of
wall time (`--max-time T`; the plain loop stops there): minigpt's CPU recipe, the same with its threads
fixed at every core (as before they were measured), nanoGPT's shakespeare_char CPU recipe through minigpt,
and the plain loop at nanoGPT's shape. Each runs quiet and busy, interleaved; the table gives their steps
and the share of the quiet steps each keeps. Linux only (taskset). Needs ../shared/data/tinyshakespeare.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OVERHEAD = Path(__file__).resolve().parent / "bench_overhead.py"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
# (layers, heads, width, block), batch, (short, long) step counts
SHAPES = {
    "4x4x128, block 64, batch 12": ((4, 4, 128, 64), 12, (50, 350)),
    "6x6x384, block 256, batch 8": ((6, 6, 384, 256), 8, (5, 25)),
}
SPINS = ("10000", "300000")  # minigpt.train.spin's candidates
NANOGPT = (
    "--n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 12 --arch gpt2 --optimizer adamw --lr 1e-3 "
    "--min-lr 1e-4 --warmup 100 --schedule cosine --beta1 0.9 --eval-every 250 --eval-iters 20 --dtype float32"
).split()


def load() -> float:
    return os.getloadavg()[0]


def command(args: list[str], env: dict[str, str]) -> tuple[float, str, float]:
    """Run one whole command: its wall seconds, its stderr and the load average as it started."""
    before = load()
    started = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)}\n{proc.stderr[-3000:]}")
    return wall, proc.stderr, before


def environment(cache: Path, spin: str | None = None, measure: bool = False) -> dict[str, str]:
    """The commands' environment: a shared cache, no thread count of ours, measuring as minigpt decides
    unless `measure` forces it, and the OpenMP spin unset (minigpt chooses its own; the plain loop keeps
    libgomp's) unless `spin` forces one."""
    drop = ("GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MINIGPT_MEASURE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= {"MINIGPT_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    if measure:
        env["MINIGPT_MEASURE"] = "on"
    return env


def minigpt_train(out: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "minigpt", "train", str(SHAKESPEARE), "--tokenizer", "char", "--device", "cpu",
            "--out", str(out), "--overwrite", *flags]  # fmt: skip


def shape_flags(shape: tuple[int, ...], batch: int) -> list[str]:
    layers, heads, width, block = shape
    return ["--n-layer", str(layers), "--n-head", str(heads), "--n-embd", str(width), "--block-size",
            str(block), "--batch-size", str(batch), "--arch", "gpt2", "--optimizer", "adamw", "--eval-iters", "2"]  # fmt: skip


PLAIN = "plain PyTorch loop, textbook GPT-2, float32"  # the ratios' base
PLAIN_MODULE = (
    "plain loop, minigpt's GPT module, float32"  # the trainer's own overhead, apart from the model's
)


def plain_loop(
    shape: tuple[int, ...], batch: int, steps: int, seconds: float = 0.0, textbook: bool = True
) -> list[str]:
    return [sys.executable, str(OVERHEAD), "--plain-loop", str(steps), "--shape", ",".join(map(str, shape)),
            "--batch", str(batch), "--seconds", str(seconds), *["--textbook"] * textbook]  # fmt: skip


def settled(cores: int, wait: float = 120.0) -> None:
    """Wait (up to `wait` seconds) for the load average to fall under half the cores, where minigpt
    measures: a benchmark just before leaves the one-minute average high for a while."""
    waited = 0.0
    while load() >= cores / 2 and waited < wait:
        time.sleep(5.0)
        waited += 5.0
    if load() >= cores / 2:
        print(
            f"the load is {load():.1f} on {cores} cores: the measurements time other work too",
            file=sys.stderr,
        )


def measured_choices(tmp: Path) -> dict[str, dict[str, Any]]:
    """One short run per shape in the fresh cache: what minigpt measured and said about it."""
    settled(os.cpu_count() or 1)
    found = {}
    for name, (shape, batch, _) in SHAPES.items():
        out = tmp / "choices"
        _, log, before = command(
            minigpt_train(out, [*shape_flags(shape, batch), "--max-iters", "3"]),
            environment(tmp / "cache", measure=True),
        )
        machine = json.loads((out / "config.json").read_text())["machine"]
        found[name] = {**machine, "load": before}
        print(f"{name}: {machine['summary']} (load {before:.1f})", file=sys.stderr, flush=True)
    return found


def rows_of(choice: dict[str, Any]) -> dict[str, tuple[list[str], str | None]]:
    """A shape's minigpt rows: their extra flags and forced spin (None: minigpt's choice)."""
    dtype, attention = choice["precision"]["dtype"], choice["precision"].get("attention_dtype")
    spin = choice["openmp_spin"].split()[2] if choice["openmp_spin"].split()[2] in SPINS else SPINS[0]
    other_dtype = "float32" if dtype == "bfloat16" else "bfloat16"
    other_spin = SPINS[1 - SPINS.index(spin)]
    chosen = f"{dtype}, attention {attention}" if attention else dtype
    rows: dict[str, tuple[list[str], str | None]] = {
        f"minigpt, as chosen ({chosen}, spin {spin})": ([], None),
        f"minigpt, --dtype {other_dtype}": (["--dtype", other_dtype], None),
    }
    if attention:  # bf16 autocast's attention over few keys: float32 or bf16 products
        other = "float32" if attention == "bfloat16" else "bfloat16"
        rows[f"minigpt, --attention-dtype {other}"] = (["--attention-dtype", other], None)
    rows[f"minigpt, GOMP_SPINCOUNT={other_spin}"] = ([], other_spin)
    return rows


def threads_kept(log: str) -> str:
    """The last thread count a run's log says it chose."""
    counts = re.findall(r"^threads: (\d+) from step", log, flags=re.MULTILINE)
    return counts[-1] if counts else "-"


def ratios(tmp: Path, choices: dict[str, dict[str, Any]], repeats: int, scale: float = 1.0) -> list[str]:
    lines = ["| shape | program | tokens/s | each repeat (load) | vs the plain loop | threads kept |",
             "|---|---|---:|---|---:|---:|"]  # fmt: skip
    for name, (shape, batch, counts) in SHAPES.items():
        short, long = (max(2, round(scale * n)) for n in counts)
        runs = {PLAIN: ([], None), PLAIN_MODULE: ([], None), **rows_of(choices[name])}
        rates: dict[str, list[tuple[float, float]]] = {row: [] for row in runs}
        threads: dict[str, str] = {}
        tokens = (long - short) * batch * shape[3]
        for _ in range(repeats):
            for row, (flags, spin) in runs.items():
                times, loads = [], []
                for steps in (short, long):
                    if row.startswith("plain"):
                        args = plain_loop(shape, batch, steps, textbook=row == PLAIN)
                    else:
                        args = minigpt_train(
                            tmp / "run", [*shape_flags(shape, batch), "--max-iters", str(steps), *flags]
                        )
                    wall, log, before = command(args, environment(tmp / "cache", spin))
                    times.append(wall)
                    loads.append(before)
                    threads[row] = threads_kept(log)
                rates[row].append((tokens / (times[1] - times[0]), max(loads)))
                print(
                    f"{name}, {row}: {rates[row][-1][0]:,.0f} tokens/s, load {max(loads):.1f}",
                    file=sys.stderr,
                    flush=True,
                )
        base = statistics.median(r for r, _ in rates[PLAIN])
        for row, got in rates.items():
            med = statistics.median(r for r, _ in got)
            each = ", ".join(f"{rate:,.0f} ({at:.1f})" for rate, at in got)
            lines.append(f"| {name} | {row} | {med:,.0f} | {each} | {med / base:.2f}x | {threads[row]} |")
    return lines


def evaluations(tmp: Path, repeats: int) -> list[str]:
    """Each shape's evaluation (50 batches of windows on each split) in passes of the batch size (the CPU's
    default), of 256 (the rule before) and of four batches: whole commands, each timed at --eval-iters 50
    and 1 so that all else cancels."""
    lines = ["| shape | windows a pass | evaluation (s) | each repeat (load) | vs the batch size |",
             "|---|---|---:|---|---:|"]  # fmt: skip
    for name, (shape, batch, _) in SHAPES.items():
        rows = {
            f"{batch}, the batch size (the default)": [],
            "256 (the rule before)": ["--eval-chunk", "256"],
        }
        rows[f"{4 * batch}, four batches"] = ["--eval-chunk", str(4 * batch)]
        got: dict[str, list[tuple[float, float]]] = {row: [] for row in rows}
        for _ in range(repeats):
            for row, flags in rows.items():
                walls, loads = [], []
                for iters in ("1", "50"):
                    more = [*shape_flags(shape, batch), "--max-iters", "2", *flags, "--eval-iters", iters]
                    wall, _, before = command(minigpt_train(tmp / "run", more), environment(tmp / "cache"))
                    walls.append(wall)
                    loads.append(before)
                got[row].append((walls[1] - walls[0], max(loads)))
                print(f"{name}, evaluation {row}: {got[row][-1][0]:.2f} s", file=sys.stderr, flush=True)
        base = statistics.median(s for s, _ in next(iter(got.values())))
        for row, timed in got.items():
            med = statistics.median(s for s, _ in timed)
            each = ", ".join(f"{s:.2f} ({at:.1f})" for s, at in timed)
            lines.append(f"| {name} | {row} | {med:.2f} | {each} | {med / base:.2f}x |")
    return lines


def done_steps(log: str) -> int:
    """The steps a minigpt run or the plain loop reports having taken."""
    found = re.findall(r"after ([\d,]+) steps|plain loop: (\d+) steps", log)
    return int((found[-1][0] or found[-1][1]).replace(",", ""))


def busy_programs(tmp: Path, seconds: float) -> dict[str, list[str]]:
    """The --busy comparison's programs: each minigpt run's flags without its budget, or the plain loop's
    whole command (the quiet machine's measured choices are made by short runs of the minigpt ones first)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {
        "minigpt, the CPU recipe": [],
        f"minigpt, the CPU recipe on --threads {cores}": ["--threads", str(cores)],
        "minigpt, nanoGPT's recipe": NANOGPT,
        "plain PyTorch loop, nanoGPT's shape": plain_loop((4, 4, 128, 64), 12, 10**9, seconds),
    }


def taking_a_core(args: list[str], env: dict[str, str]) -> tuple[float, str, float]:
    """`command` while `taskset -c 0 python -c "while True: pass"` holds the first core."""
    rival = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    time.sleep(1.0)  # the rival holds its core before the run starts
    try:
        return command(args, env)
    finally:
        rival.kill()
        rival.wait()


def busy(tmp: Path, seconds: float, repeats: int) -> list[str]:
    programs = busy_programs(tmp, seconds)
    settled(os.cpu_count() or 1)
    for flags in programs.values():
        if flags[:1] != [sys.executable]:
            run = minigpt_train(tmp / "run", [*flags, "--max-iters", "2"])
            command(run, environment(tmp / "cache", measure=True))
    steps: dict[str, dict[str, list[int]]] = {p: {"quiet": [], "busy": []} for p in programs}
    for _ in range(repeats):
        for program, flags in programs.items():
            timed = ["--max-time", f"{seconds:g}s", "--max-iters", "1000000"]
            args = flags if flags[:1] == [sys.executable] else minigpt_train(tmp / "run", [*flags, *timed])
            for condition, run in (("quiet", command), ("busy", taking_a_core)):
                _, log, before = run(args, environment(tmp / "cache"))
                steps[program][condition].append(done_steps(log))
                print(f"{program}, {condition}: {steps[program][condition][-1]:,} steps, load {before:.1f}",
                      file=sys.stderr, flush=True)  # fmt: skip
    lines = [
        f"| --max-time {seconds:g}s | quiet steps | busy steps (one core taken) | kept |",
        "|---|---:|---:|---:|",
    ]
    for program, got in steps.items():
        quiet, taken = statistics.median(got["quiet"]), statistics.median(got["busy"])
        kept = f"{taken / quiet:.0%}" if quiet else "-"
        lines.append(f"| {program} | {quiet:,.0f} | {taken:,.0f} | {kept} |")
    return lines


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
        found = re.search(r"^model name\s*:\s*(.+)$", info, flags=re.MULTILINE)
        return found.group(1).strip() if found else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every row (median)")
    parser.add_argument(
        "--busy", metavar="SECONDS", help="time budget of the one-core-taken comparison (75s)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="the ratios' step counts times this (0.2: quick)"
    )
    parser.add_argument(
        "--only", choices=("ratios", "evaluations"), help="after the choices, only this table (default: both)"
    )
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    import torch  # only for its version, printed with the table

    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}; load before: {load():.1f}\n")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if args.busy:
            print("\n".join(busy(tmp, float(args.busy.rstrip("s")), args.repeats)))
            return
        choices = measured_choices(tmp)
        print("| shape | what `minigpt train` chose on this machine (load while measuring) |\n|---|---|")
        for name, choice in choices.items():
            print(f"| {name} | {choice['summary']} ({choice['load']:.1f}) |")
        if args.only != "evaluations":
            print(f"\nwhole commands, medians of {args.repeats} interleaved repeats\n")
            print("\n".join(ratios(tmp, choices, args.repeats, args.scale)))
        if args.only != "ratios":
            print(f"\nevaluations, whole commands, medians of {args.repeats} interleaved repeats\n")
            print("\n".join(evaluations(tmp, args.repeats)))
    print(f"\nload after: {load():.1f}")


if __name__ == "__main__":
    main()
