"""Ingest of a folder of many tiny files against a few files of the same total size: `minigpt prepare` (char
tokenizer) in a fresh process on a cold cache, timed, for each folder; and the same for fewer tiny files,
so the time per file shows whether ingest is linear in the number of files.

Usage: python bench/bench_ingest_files.py [--files 100000] [--few 10] [--bytes 2800000]
                                          [--scales 10000,30000] [--repeat 1] [--work /tmp]

Prints one markdown row per folder: files, bytes, seconds (the best of --repeat runs), seconds per file,
and the startup (the same command on one tiny file) taken out. The generated folders are deleted at the
end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = "the king spoke to the queen of the bread and the corn\n"


def make_folder(folder: Path, files: int, total_bytes: int) -> int:
    """`files` text files of total_bytes / files bytes each (its number, then words): bytes written."""
    per_file = max(total_bytes // files, 16)
    text = LINE * (per_file // len(LINE) + 1)
    folder.mkdir(parents=True)
    for i in range(files):
        sub = folder / f"{i // 1000:03d}" if files > 1000 else folder  # a thousand files a folder
        sub.mkdir(exist_ok=True)
        head = f"{i} "
        (sub / f"doc{i:06d}.txt").write_text(head + text[: per_file - len(head)], encoding="utf-8")
    return sum(p.stat().st_size for p in folder.rglob("*.txt"))


def prepare_seconds(folder: Path, cache: Path) -> float:
    """Wall seconds of `minigpt prepare FOLDER --tokenizer char` on an empty cache."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "minigpt", "prepare", str(folder), "--tokenizer", "char"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"prepare {folder} failed:\n{proc.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000, help="tiny files in the large folder")
    parser.add_argument("--few", type=int, default=10, help="files holding the same bytes")
    parser.add_argument("--bytes", type=int, default=2_800_000, help="bytes of text in each folder")
    parser.add_argument("--scales", default="10000,30000", help="fewer tiny files (same bytes per file)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per folder; the best is shown")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=args.work))
    per_tiny = args.bytes // args.files
    counts = sorted({int(s) for s in args.scales.split(",") if s} | {args.files})
    try:
        make_folder(work / "one", 1, per_tiny)
        startup = min(prepare_seconds(work / "one", work / "cache") for _ in range(args.repeat))
        print(f"startup (one tiny file): {startup:.2f}s; load average {os.getloadavg()[0]:.1f}")
        print("| files | bytes | seconds | ms per file | ms per file, startup taken out |")
        print("|---:|---:|---:|---:|---:|")
        written = 0
        for files in [*counts, args.few]:
            folder = work / f"files-{files}"
            # the few files hold what the most tiny files held, to the byte
            written = make_folder(folder, files, written if files == args.few else files * per_tiny)
            seconds = min(prepare_seconds(folder, work / "cache") for _ in range(args.repeat))
            print(
                f"| {files:,} | {written:,} | {seconds:.1f} | {1e3 * seconds / files:.3f} | "
                f"{1e3 * (seconds - startup) / files:.3f} |",
                flush=True,
            )
            shutil.rmtree(folder)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
