"""Corpora at scale: each phase of preparing a generated corpus (as .txt, .jsonl.zst and Parquet), its speed
beside tiktoken's own encode_ordinary_batch on the same text in memory, peak memory, and the time from the
command to the first training step, cold and warm; optionally the same on 10 GB, and what training the
tokenizer on a sample costs in bits per byte. Prints the README's tables (markdown).

Usage: python bench/bench_corpus.py [--gb 1] [--formats txt,jsonl.zst,parquet] [--big-gb 10 --big-formats txt]
                                    [--sample-cost-mb 200] [--work /tmp]

Every measurement runs in a fresh process (its peak RSS is its own) on a cold cache unless it says warm.
Generated files are deleted at the end (and at the start, if a killed run left them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
R50K = ROOT.parent / "shared" / "data" / "r50k_base.tiktoken"
TXT_FILE_BYTES = 16 << 20  # a .txt corpus is a folder of files this large (each one document)
SHARD_BYTES = 128 << 20  # JSON lines and Parquet shards


# ---------------------------------------------------------------------------------------------- corpus


def vocabulary(seed: int = 0, size: int = 30_000) -> list[str]:
    """Pseudo-words of 1-3 syllables, shortest first (the Zipf ranks): text that BPE treats like language."""
    import numpy as np

    rng = np.random.default_rng(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "ch",
    ]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    picks = rng.integers(0, len(syllables), size=(4 * size, 3))
    counts = rng.integers(1, 4, size=4 * size)
    words = dict.fromkeys(
        "".join(syllables[i] for i in row[:k]) for row, k in zip(picks, counts, strict=True)
    )
    return sorted(list(words)[:size], key=lambda w: (len(w), w))


SENTENCES = 200_000  # distinct sentences documents are drawn from (in any order, so no two alike)


def sentences(seed: int = 0) -> list[str]:
    """Sentences of 4-30 words over the vocabulary (Zipf frequencies, capitals, numbers, punctuation)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = vocabulary(seed)
    cdf = np.cumsum(1 / np.arange(1, len(words) + 1) ** 1.07)
    lengths = rng.integers(4, 31, size=SENTENCES)
    ids = np.searchsorted(cdf, rng.random(int(lengths.sum())) * cdf[-1])
    ends = rng.choice([". ", ". ", "? ", "! ", ".\n\n", ", and "], size=SENTENCES)
    out, at = [], 0
    for n, k in enumerate(lengths):
        ws = [words[i] for i in ids[at : at + k]]
        at += k
        if n % 7 == 0:
            ws.insert(int(rng.integers(0, k)), str(int(rng.integers(0, 100_000))))
        out.append(" ".join(ws).capitalize() + ends[n])
    return out


def documents(total_bytes: int, seed: int = 0):
    """Documents of 5-200 sentences drawn from the pool, about total_bytes of UTF-8 in all; the same seed
    gives the same text."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    pool = np.array(sentences(seed), dtype=object)
    done = n = 0
    while done < total_bytes:
        k = int(rng.integers(5, 201))
        text = f"Entry {n}. " + "".join(pool[rng.integers(0, len(pool), size=k)]).strip() + "\n"
        done += len(text)
        n += 1
        yield text


def write_corpus(folder: Path, fmt: str, total_bytes: int, seed: int = 0) -> int:
    """The generated documents as fmt (txt, jsonl.zst or parquet) under folder; their text bytes. Written
    through to the disk before it returns: a user's corpus is on disk, and gigabytes of dirty pages still
    being flushed would slow whatever is measured next."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(total_bytes, seed)
    writer = {"txt": _write_txt, "jsonl.zst": _write_jsonl_zst}.get(fmt, _write_parquet)
    text = writer(folder, docs)
    os.sync()
    return text


def _write_txt(folder: Path, docs) -> int:
    text, size, n, part = 0, 0, 0, []
    for d in docs:
        part.append(d)
        size += len(d)
        if size >= TXT_FILE_BYTES:
            text += _flush_txt(folder / f"part-{n:05d}.txt", part)
            part, size, n = [], 0, n + 1
    return text + (_flush_txt(folder / f"part-{n:05d}.txt", part) if part else 0)


def _flush_txt(path: Path, docs: list[str]) -> int:
    data = "\n".join(docs).encode()
    path.write_bytes(data)
    return len(data)


def _write_jsonl_zst(folder: Path, docs) -> int:
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    text, n, size, f = 0, 0, 0, None
    for d in docs:
        if f is None:
            f = zstd.open(folder / f"shard-{n:05d}.jsonl.zst", "wb", level=3)
        f.write((json.dumps({"id": text, "text": d}) + "\n").encode())
        text += len(d.encode())
        size += len(d)
        if size >= SHARD_BYTES:
            f.close()
            f, size, n = None, 0, n + 1
    if f is not None:
        f.close()
    return text


def _write_parquet(folder: Path, docs) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text, n, batch, size = 0, 0, [], 0
    for d in docs:
        batch.append(d)
        text += len(d.encode())
        size += len(d)
        if size >= SHARD_BYTES:
            pq.write_table(pa.table({"text": batch}), folder / f"shard-{n:05d}.parquet", row_group_size=8192)
            batch, size, n = [], 0, n + 1
    if batch:
        pq.write_table(pa.table({"text": batch}), folder / f"shard-{n:05d}.parquet", row_group_size=8192)
    return text


# ---------------------------------------------------------------------------------------------- children

# prepare in phases, each timed: hash, tokenizer, encode (a cold store), then peak RSS: VmHWM, the process's
# own peak (its ru_maxrss would also carry this benchmark's peak, which Linux passes on across fork and exec:
# 633 MB reported for a 10 GB prepare that peaked at about 110 MB, after the corpus was generated here)
PREPARE = r"""
import json, sys, time
from pathlib import Path
a = json.loads(sys.argv[1])
sys.path.insert(0, a["root"])
from minigpt.data.dataset import DataConfig, find_inputs, prepare_tokenizer, prepare_data
cfg = DataConfig(paths=(Path(a["input"]),), tokenizer=a["tokenizer"], cache_dir=Path(a["cache"]))
t = [time.perf_counter()]
inputs = find_inputs(cfg, False); t.append(time.perf_counter())
tok = prepare_tokenizer(cfg, inputs, False); t.append(time.perf_counter())
ds = prepare_data(cfg, 256, tok, False, inputs=inputs); t.append(time.perf_counter())
tokens, text = ds.ingest.totals()
print(json.dumps({"hash": t[1] - t[0], "tokenizer": t[2] - t[1], "encode": t[3] - t[2], "tokens": tokens,
                  "text": text, "rss": next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024}))
"""

# tiktoken's own encode_ordinary_batch on the same text, generated in memory, in batches of ~64 MB
REFERENCE = r"""
import json, sys, time
a = json.loads(sys.argv[1])
sys.path.insert(0, a["root"]); sys.path.insert(0, a["bench"])
from bench_corpus import documents, TXT_FILE_BYTES
from minigpt.tokenizer.load import build_tokenizer; from minigpt.tokenizer.base import default_threads
enc = build_tokenizer(a["tokenizer"]).encoding
docs = documents(a["bytes"], a["seed"])
if a["fmt"] == "txt":  # the files' text, as minigpt reads them: one string per file
    def files(docs):
        part, size = [], 0
        for d in docs:
            part.append(d); size += len(d)
            if size >= TXT_FILE_BYTES:
                yield "\n".join(part); part, size = [], 0
        if part: yield "\n".join(part)
    docs = files(docs)
seconds = text = 0.0
batch, size = [], 0
def run(batch):
    t = time.perf_counter(); enc.encode_ordinary_batch(batch, num_threads=default_threads())
    return time.perf_counter() - t
for d in docs:
    batch.append(d); size += len(d)
    if size >= 64 << 20:
        seconds += run(batch); text += sum(len(x.encode()) for x in batch); batch, size = [], 0
if batch:
    seconds += run(batch); text += sum(len(x.encode()) for x in batch)
print(json.dumps({"seconds": seconds, "text": text}))
"""


# the bpe learned from a sample of `sample` bytes: its training time, and bytes per token on validation
SAMPLE = r"""
import json, sys, time
from pathlib import Path
a = json.loads(sys.argv[1])
sys.path.insert(0, a["root"])
from minigpt.data.dataset import DataConfig, find_inputs, prepare_tokenizer, prepare_data
cfg = DataConfig(paths=(Path(a["input"]),), tokenizer_sample=a["sample"], cache_dir=Path(a["cache"]))
inputs = find_inputs(cfg, False)
t = time.perf_counter(); tok = prepare_tokenizer(cfg, inputs, False); seconds = time.perf_counter() - t
Path(a["out"]).write_text(json.dumps(tok.to_json()))
ds = prepare_data(DataConfig(paths=(Path(a["input"]),), tokenizer=a["out"], cache_dir=Path(a["cache"])), 256,
                  progress=False, inputs=inputs)
print(json.dumps({"seconds": seconds, "bytes_per_token": ds.val_bytes / len(ds.val)}))
"""


def child(code: str, args: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def first_step(files: Path, tokenizer: str, cache: Path, out: Path) -> tuple[float, float]:
    """(seconds from the command to its first training step, peak RSS MB of the command)."""
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    wrapper = (
        "import resource, subprocess, sys, time, signal\n"
        "t = time.perf_counter()\n"
        "p = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE, text=True)\n"
        "seen = None\n"
        "for line in p.stderr:\n"
        "    if seen is None and line.lstrip().startswith('step') and '|' in line:\n"
        "        seen = time.perf_counter() - t\n"
        "        p.send_signal(signal.SIGINT)\n"
        "p.wait()\n"
        "print(seen, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
    )
    cmd = [sys.executable, "-m", "minigpt", "train", str(files), "--tokenizer", tokenizer, "--max-iters", "1000",
           "--out", str(out), "--overwrite", "--device", "cpu"]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env, cwd=ROOT
    )
    seen, rss = res.stdout.split()
    if seen == "None":
        raise SystemExit(f"no training step seen:\n{res.stderr[-2000:]}")
    return float(seen), float(rss)


def sample_cost(work: Path, mb: float, steps: int) -> list[str]:
    """BPE (512) learned from all of an mb-MB corpus, from the default sample and from a smaller one: its
    training time, its bytes per token on the validation documents, and the validation bits per byte of the
    same model trained `steps` steps on each (same seed, same documents)."""
    from minigpt.data.config import DEFAULT_TOKENIZER_SAMPLE

    folder = work / "sample_txt"
    write_corpus(folder, "txt", int(mb * 1e6), seed=1)
    rows = []
    try:
        for sample, label in ((int(mb * 2e6), "all of it"), (DEFAULT_TOKENIZER_SAMPLE, "64 MB (default)"),
                              (16 << 20, "16 MB")):  # fmt: skip
            cache, tok = work / "cache-sample", work / "tokenizer.json"
            shutil.rmtree(cache, ignore_errors=True)
            args = {
                "root": str(ROOT),
                "input": str(folder),
                "sample": sample,
                "cache": str(cache),
                "out": str(tok),
            }
            r = child(SAMPLE, args)
            out = work / "run-sample"
            cmd = [sys.executable, "-m", "minigpt", "train", str(folder), "--tokenizer", str(tok), "--max-iters",
                   str(steps), "--out", str(out), "--overwrite", "--device", "cpu", "--seed", "1"]  # fmt: skip
            env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache)}
            subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
            bpb = json.loads((out / "config.json").read_text())["metrics"]["best_val_bpb"]
            shutil.rmtree(cache, ignore_errors=True)
            rows.append(
                f"| {label} | {r['seconds']:.1f} | {r['bytes_per_token']:.3f} | {bpb:.4f} | {load()} |"
            )
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def train_cost(work: Path, fmt: str, folder: Path, steps: int) -> str:
    """Training tokens/s while the corpus is tokenized beside it (a cold store) and on a tokenized one."""
    rates = []
    cache = work / "cache-cost"
    shutil.rmtree(cache, ignore_errors=True)
    for _ in ("cold", "warm"):
        out = work / "run-cost"
        cmd = [sys.executable, "-m", "minigpt", "train", str(folder), "--max-iters", str(steps), "--log-every",
               "5", "--eval-every", str(10 * steps), "--out", str(out), "--overwrite", "--device", "cpu"]  # fmt: skip
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache)}
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps_ = [r for r in records if r["kind"] == "train" and r["step"] >= 5]
        first, last = steps_[0], steps_[-1]
        rates.append((last["tokens"] - first["tokens"]) / (last["elapsed"] - first["elapsed"]))
    shutil.rmtree(cache, ignore_errors=True)
    row = f"| {fmt} | {rates[0]:,.0f} | {rates[1]:,.0f} | {rates[0] / rates[1]:.2f}x | {load()} |"
    print(row, flush=True)
    return row


# ---------------------------------------------------------------------------------------------- tables


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def phases(work: Path, fmt: str, gb: float, folder: Path, text_bytes: int) -> list[str]:
    """Each phase of a cold prepare with r50k_base and with bpe trained in the run, and tiktoken's batch
    encoder on the same text in memory (r50k_base), run before and after minigpt's r50k_base prepare (the
    machine's speed drifts over minutes: the reference is their mean)."""
    cache = work / "cache-phases"
    rows = []
    ref_args = {"root": str(ROOT), "bench": str(ROOT / "bench"), "tokenizer": str(R50K),
                "bytes": int(gb * 1e9), "seed": 0, "fmt": fmt}  # fmt: skip
    before = child(REFERENCE, ref_args)
    for tokenizer, label in ((str(R50K), "r50k_base"), ("bpe", "bpe 512 (trained)")):
        shutil.rmtree(cache, ignore_errors=True)
        args = {"root": str(ROOT), "input": str(folder), "tokenizer": tokenizer, "cache": str(cache)}
        ours = child(PREPARE, args)
        shutil.rmtree(cache, ignore_errors=True)
        if tokenizer != "bpe":
            after = child(REFERENCE, ref_args)
            print(f"tiktoken batch before and after: {before['seconds']:.1f} s, {after['seconds']:.1f} s")
        ref_mbs = before["text"] / 1e6 / ((before["seconds"] + after["seconds"]) / 2)
        mbs = ours["text"] / 1e6 / ours["encode"]
        pipe = ours["text"] / 1e6 / (ours["hash"] + ours["encode"])
        same = tokenizer != "bpe"
        rows.append(
            f"| {fmt} | {label} | {text_bytes / 1e9:.2f} | {ours['hash']:.1f} | {ours['tokenizer']:.1f} | "
            f"{ours['encode']:.1f} | {mbs:.1f} | {pipe:.1f} | {ref_mbs if same else 0:.1f} | "
            f"{f'{pipe / ref_mbs:.2f}x' if same else '—'} | {ours['rss']:.0f} | {load()} |"
        )
        print(rows[-1], flush=True)
    return rows


def starts(work: Path, fmt: str, folder: Path) -> list[str]:
    rows = []
    for tokenizer, label in ((str(R50K), "r50k_base"), ("bpe", "bpe 512 (trained)")):
        cache = work / "cache-start"
        shutil.rmtree(cache, ignore_errors=True)
        cold, cold_rss = first_step(folder, tokenizer, cache, work / "run")
        # the cold run stopped at its first step: finish the store, as `minigpt prepare` does
        env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache)}
        cmd = [sys.executable, "-m", "minigpt", "prepare", str(folder), "--tokenizer", tokenizer]
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        warm, warm_rss = first_step(folder, tokenizer, cache, work / "run")
        shutil.rmtree(cache, ignore_errors=True)
        rows.append(
            f"| {fmt} | {label} | {cold:.1f} | {warm:.1f} | {max(cold_rss, warm_rss):.0f} | {load()} |"
        )
        print(rows[-1], flush=True)
    return rows


def big_run(work: Path, fmt: str, gb: float, full: bool) -> tuple[list[str], list[str]]:
    """The large corpus: the first step cold with each tokenizer (a fresh store each) and, with `full`, the
    whole corpus tokenized (r50k_base: each phase's time and the peak RSS, to set beside the smaller
    corpus's row; no tiktoken reference, whose time is as linear as ours) and the first step warm."""
    folder = work / f"big_{fmt.replace('.', '_')}"
    t = time.perf_counter()
    text = write_corpus(folder, fmt, int(gb * 1e9))
    print(f"generated {fmt}: {text / 1e9:.2f} GB of text, {time.perf_counter() - t:.0f}s", flush=True)
    label = f"{fmt} ({text / 1e9:.0f} GB)"
    phase_rows, start_rows = [], []
    try:
        for tokenizer, name in ((str(R50K), "r50k_base"), ("bpe", "bpe 512 (trained)")):
            cache = work / "cache-big"
            shutil.rmtree(cache, ignore_errors=True)
            cold, rss = first_step(folder, tokenizer, cache, work / "run")
            warm = "—"
            if full and tokenizer != "bpe":
                shutil.rmtree(cache, ignore_errors=True)
                args = {"root": str(ROOT), "input": str(folder), "tokenizer": tokenizer, "cache": str(cache)}
                ours = child(PREPARE, args)
                mbs = ours["text"] / 1e6 / ours["encode"]
                phase_rows.append(
                    f"| {label} | {name} | {text / 1e9:.2f} | {ours['hash']:.1f} | {ours['tokenizer']:.1f} | "
                    f"{ours['encode']:.1f} | {mbs:.1f} | {mbs:.1f} | — | — | {ours['rss']:.0f} | {load()} |"
                )
                print(phase_rows[-1], flush=True)
                seconds, warm_rss = first_step(folder, tokenizer, cache, work / "run")
                warm, rss = f"{seconds:.1f}", max(rss, warm_rss)
            shutil.rmtree(cache, ignore_errors=True)
            start_rows.append(f"| {label} | {name} | {cold:.1f} | {warm} | {rss:.0f} | {load()} |")
            print(start_rows[-1], flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return phase_rows, start_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the generated corpus (GB of text)")
    parser.add_argument("--formats", default="txt,jsonl.zst,parquet")
    parser.add_argument("--big-gb", type=float, default=0, help="also a run on this many GB, e.g. 10")
    parser.add_argument(
        "--big-formats", default="txt,jsonl.zst,parquet", help="formats of the big run (txt: also tokenized)"
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--sample-cost-mb", type=float, default=0, help="measure the tokenizer sample on this"
    )
    parser.add_argument("--sample-steps", type=int, default=200, help="training steps per tokenizer")
    parser.add_argument("--cost-steps", type=int, default=0, help="measure training beside tokenizing")
    parser.add_argument("--skip-phases", action="store_true")
    parser.add_argument("--skip-starts", action="store_true")
    opts = parser.parse_args()
    if not R50K.is_file():
        sys.exit(f"needs {R50K}")
    sys.path.insert(0, str(ROOT))
    from minigpt.tokenizer.base import default_threads

    work = opts.work / "minigpt-bench-corpus"
    shutil.rmtree(work, ignore_errors=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs, {default_threads()} tokenizer threads, Python {sys.version.split()[0]}; "
          f"load averages (1/5/15 min) beside each row.\n")  # fmt: skip
    phase_rows, start_rows, sample_rows, cost_rows = [], [], [], []
    try:
        if opts.sample_cost_mb:
            sample_rows = sample_cost(work, opts.sample_cost_mb, opts.sample_steps)
        for fmt in filter(None, opts.formats.split(",")):
            folder = work / fmt.replace(".", "_")
            t = time.perf_counter()
            text = write_corpus(folder, fmt, int(opts.gb * 1e9))
            on_disk = sum(f.stat().st_size for f in folder.iterdir())
            print(f"generated {fmt}: {text / 1e9:.2f} GB of text, {on_disk / 1e9:.2f} GB on disk, "
                  f"{time.perf_counter() - t:.0f}s", flush=True)  # fmt: skip
            if not opts.skip_phases:
                phase_rows += phases(work, fmt, opts.gb, folder, text)
            if not opts.skip_starts:
                start_rows += starts(work, fmt, folder)
            if opts.cost_steps:
                cost_rows.append(train_cost(work, fmt, folder, opts.cost_steps))
            shutil.rmtree(folder)
        for fmt in filter(None, opts.big_formats.split(",")) if opts.big_gb else ():
            big = big_run(work, fmt, opts.big_gb, full=fmt == "txt")
            phase_rows += big[0]
            start_rows += big[1]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n### Preparing a corpus, phase by phase (cold store)\n")
    print("| format | tokenizer | GB of text | hash s | tokenizer s | encode s | encode MB/s | pipeline MB/s | "
          "tiktoken batch MB/s | pipeline vs tiktoken | peak RSS MB | load |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(phase_rows))
    print("\n### From the command to the first training step\n")
    print("| corpus | tokenizer | cold s | warm s | peak RSS MB | load |")
    print("|---|---|---:|---:|---:|---|")
    print("\n".join(start_rows))
    if cost_rows:
        print("\n### Training while tokenizing goes on beside it (default bpe and model, steps 5 on)\n")
        print("| corpus | tokens/s, tokenizing beside | tokens/s, corpus tokenized | ratio | load |")
        print("|---|---:|---:|---:|---|")
        print("\n".join(cost_rows))
    if sample_rows:
        print(f"\n### BPE learned from a sample of a {opts.sample_cost_mb:g} MB corpus\n")
        print(
            f"| learned from | training s | validation bytes/token | val bits/byte after {opts.sample_steps} steps | load |"
        )
        print("|---|---:|---:|---:|---|")
        print("\n".join(sample_rows))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # so the finally clause deletes the corpus
    main()
