"""minigpt against llama.cpp: batch-1 decoding of the same weights, in the same dtype, on the same threads.

Not part of CI: it needs llama.cpp's binaries (`../shared/tools/llama.cpp/bin` here) and a GGUF of a
minigpt run. Both sides run as whole commands, as a user runs them, round robin, `--repeats` times, with
the same prompt, length and seed, on 1 and 2 threads (OMP_NUM_THREADS and OPENBLAS_NUM_THREADS for
minigpt, -t for llama.cpp), and once each on its own choice of threads. Compared: tokens/s over the
generation (prompt, decoding and sampling, start-up and loading left out: llama.cpp's own timings, and
`minigpt generate --json`'s), and the whole command's wall time.

    # a random 6x6x384 model with the default tokenizer's 512 BPE tokens (or --vocab r50k: GPT-2's), its
    # f32 GGUF, and the race
    python bench/bench_llamacpp.py --make-run /tmp/run --arch gpt2
    minigpt convert to-gguf /tmp/run /tmp/run.f32.gguf
    python bench/bench_llamacpp.py --bin ../shared/tools/llama.cpp/bin --gguf /tmp/run.f32.gguf --run /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
R50K = ROOT.parent / "shared" / "data" / "r50k_base.tiktoken"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
PROMPT = "ROMEO:"


def make_run(out: Path, arch: str, vocab: str) -> None:
    """A 6-layer, 6-head, 384-wide model (block 256) with random weights and 512 BPE tokens learned from
    tinyshakespeare (`vocab` bpe512: the default tokenizer's size, so that, as in the char model of
    bench_generate, the blocks are what a step reads) or GPT-2's tokenizer (r50k: its 50,257-token head
    is most of a step)."""
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
    config = model_config(
        arch=arch, vocab_size=tok.vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384
    )
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():  # both sides run every token: no <|endoftext|> ends a sample early (llama.cpp
        # would ignore it, minigpt stops there), so its head row is 0 and every other logit 20x wider
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[tok.eot_id] = 0.0
    RunDir(out).save(model, tok, extra={})
    print(f"wrote {out}: {arch}, vocab {tok.vocab_size}")


def clean_env(threads: int | None) -> dict[str, str]:
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return env


def llama(binary: Path, gguf: Path, n: int, threads: int | None, seed: int) -> tuple[float, float]:
    """(tokens/s over prompt, decoding and sampling; wall seconds) of one llama-completion run."""
    cmd = [str(binary), "-m", str(gguf), "-p", PROMPT, "-n", str(n), "--temp", "1", "--seed", str(seed),
           "--ignore-eos", "-no-cnv"]  # fmt: skip
    if threads is not None:
        cmd += ["-t", str(threads)]
    for _ in range(3):  # its log is written by a thread of its own, which loses the last lines now and then
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", check=True, env=clean_env(None)
        )
        wall = time.perf_counter() - t0
        names = ("sampling time", "prompt eval time", "eval time")
        found = [re.search(rf"perf_print:\s+{name} =\s+([0-9.]+) ms", proc.stderr) for name in names]
        if all(found):
            return n / (sum(float(f.group(1)) for f in found if f) / 1000), wall
    raise SystemExit(f"llama-completion printed no timings three times:\n{proc.stderr[-2000:]}")


def minigpt(run: Path, n: int, threads: int | None, seed: int) -> tuple[float, float]:
    """(tokens/s of the generation as `minigpt generate --json` reports it; wall seconds)."""
    cmd = [sys.executable, "-m", "minigpt", "generate", PROMPT, "-m", str(run), "-n", str(n), "--seed", str(seed),
           "--json"]  # fmt: skip
    env = {**clean_env(threads), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    data = json.loads(proc.stdout)
    if data["samples"][0]["completion_tokens"] != n:
        raise SystemExit(f"minigpt stopped early: {data['samples'][0]}")
    return data["tokens_per_second"], wall


def versions(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    llama_version = (proc.stdout + proc.stderr).strip().splitlines()
    import numpy

    return f"llama.cpp {' '.join(llama_version[:1]) or 'unknown'}; numpy {numpy.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--make-run", type=Path, help="write a random model with GPT-2's vocabulary here and stop"
    )
    ap.add_argument(
        "--arch", default="gpt2", choices=("gpt2", "modern"), help="its architecture (--make-run)"
    )
    ap.add_argument(
        "--vocab", default="bpe512", choices=("bpe512", "r50k"), help="its vocabulary (--make-run)"
    )
    ap.add_argument("--bin", type=Path, help="llama.cpp's bin directory (holding llama-completion)")
    ap.add_argument("--gguf", type=Path, help="the GGUF of --run's weights")
    ap.add_argument("--run", type=Path, help="the minigpt run directory")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per run (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin repeats, medians shown (default 3)")
    ap.add_argument("--threads", default="1,2,auto", help="thread counts; auto: each side's own choice")
    args = ap.parse_args()
    if args.make_run:
        make_run(args.make_run, args.arch, args.vocab)
        return
    if not (args.bin and args.gguf and args.run):
        ap.error("give --bin, --gguf and --run (or --make-run)")
    binary = args.bin / "llama-completion"
    counts = [None if t == "auto" else int(t) for t in args.threads.split(",")]
    results: dict[tuple[str, int | None], list[tuple[float, float]]] = {}
    load_before = os.getloadavg()
    for repeat in range(args.repeats):
        for threads in counts:
            results.setdefault(("llama.cpp", threads), []).append(
                llama(binary, args.gguf, args.tokens, threads, repeat)
            )
            results.setdefault(("minigpt", threads), []).append(
                minigpt(args.run, args.tokens, threads, repeat)
            )
    print(
        f"\n{args.run.name} against {args.gguf.name}: {args.tokens} tokens after {PROMPT!r}, medians of "
        f"{args.repeats} round-robin repeats; {versions(binary)}; load average "
        f"{', '.join(f'{x:.1f}' for x in load_before)} before, {', '.join(f'{x:.1f}' for x in os.getloadavg())} after\n"
    )
    print(
        "| threads | llama.cpp tokens/s | minigpt tokens/s | minigpt / llama.cpp | llama.cpp command | minigpt command |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for threads in counts:
        ours = results[("minigpt", threads)]
        theirs = results[("llama.cpp", threads)]
        speed = [statistics.median(t for t, _ in side) for side in (theirs, ours)]
        wall = [statistics.median(w for _, w in side) for side in (theirs, ours)]
        label = "each its own" if threads is None else str(threads)
        print(
            f"| {label} | {speed[0]:,.1f} | {speed[1]:,.1f} | {speed[1] / speed[0]:.2f}x | {wall[0]:.2f} s | {wall[1]:.2f} s |"
        )


if __name__ == "__main__":
    main()
