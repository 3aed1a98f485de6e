"""The memory bound of a decoding step on this machine, for bench_generate.py and bench_llamacpp.py.

A cached decoding step reads every weight once, so batch 1 cannot be faster than (bytes of weights a step
reads) / (memory bandwidth), once the weights are larger than the last-level cache. The bandwidth here is
what a read-only stream over an array larger than that cache reaches (`stream_read`): four times the
cache and at least 256 MB, each thread summing one contiguous part of it in 64-byte vectors with four
sums in flight (compiled by numba: NumPy's reductions do not reach it), the best of a few passes (other
work on a shared machine only slows a pass down). The cache sizes are read from the machine (Linux's
/sys, else `lscpu`), not assumed.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

__all__ = ["caches", "caches_line", "cpu_model", "last_level_cache", "load_line", "stream_read"]

MIN_STREAM = 256 * 2**20


def caches() -> list[tuple[str, int, int]]:
    """The data caches of CPU 0: (name, bytes of one, CPUs sharing one), L1d first, from /sys, else lscpu."""
    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = (index / "level").read_text().strip()
            size = _bytes((index / "size").read_text().strip())
            shared = _cpu_count((index / "shared_cpu_list").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind != "Instruction":
            found.append((f"L{level}" + ("d" if kind == "Data" else ""), size, shared))
    return found or _lscpu_caches()


def _lscpu_caches() -> list[tuple[str, int, int]]:
    """lscpu's cache table (-C, sizes in bytes): one size and the total of all instances."""
    try:
        out = subprocess.run(
            ["lscpu", "-B", "-C=NAME,ONE-SIZE,ALL-SIZE"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    rows = [line.split() for line in out.splitlines()[1:]]
    cpus = os.cpu_count() or 1
    return [(n, int(one), cpus * int(one) // int(every)) for n, one, every in rows if not n.startswith("L1i")]


def _bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text).groups()  # type: ignore[union-attr]
    return int(number) * 1024 ** " KMG".index(unit or " ")


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a list like 0-3,8 names."""
    count = 0
    for part in cpu_list.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def caches_line() -> str:
    """The caches in words: 'L1d 32 KiB (1 CPU each), L2 1 MiB (1 CPU each), L3 32 MiB (2 CPUs each)'."""
    return ", ".join(
        f"{name} {_size(size)} ({shared} CPU{'s' if shared > 1 else ''} each)"
        for name, size, shared in caches()
    )


def _size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def last_level_cache() -> int:
    """Bytes of the largest cache (the last level); 0 where the machine says nothing."""
    return max((size for _, size, _ in caches()), default=0)


@njit(fastmath=True, parallel=True, cache=True)
def _sum_parts(a: np.ndarray, parts: int) -> float:
    """The sum of a (n, 16) float32, each of `parts` threads summing one contiguous share of its rows in
    four 16-lane sums."""
    n = a.shape[0]
    totals = np.zeros((parts, 16), dtype=np.float32)
    for t in prange(parts):
        lo, hi = n * t // parts, n * (t + 1) // parts
        s0, s1 = np.zeros(16, dtype=np.float32), np.zeros(16, dtype=np.float32)
        s2, s3 = np.zeros(16, dtype=np.float32), np.zeros(16, dtype=np.float32)
        i = lo
        while i + 4 <= hi:
            for j in range(16):
                s0[j] += a[i, j]
                s1[j] += a[i + 1, j]
                s2[j] += a[i + 2, j]
                s3[j] += a[i + 3, j]
            i += 4
        for j in range(16):
            totals[t, j] = s0[j] + s1[j] + s2[j] + s3[j]
    return float(totals.sum())


@functools.cache
def _stream() -> np.ndarray:
    """The array streamed: four times the last-level cache, at least MIN_STREAM bytes, touched once."""
    nbytes = max(4 * last_level_cache(), MIN_STREAM)
    return np.ones((nbytes // 64, 16), dtype=np.float32)


def stream_bytes() -> int:
    return _stream().nbytes


def stream_read(threads: int, passes: int = 3) -> float:
    """Bytes per second of the best of `passes` reads of the stream on `threads` threads."""
    a = _stream()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    _sum_parts(a, threads)  # compiled (or read from numba's cache) and the threads started
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        _sum_parts(a, threads)
        best = min(best, time.perf_counter() - start)
    return a.nbytes / best


def cpu_model() -> str:
    """lscpu's model name."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown CPU"


def load_line() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())
