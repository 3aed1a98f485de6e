"""OpenMP's spin-wait for training (GOMP_SPINCOUNT), measured on this machine before torch loads.

GNU OpenMP, the OpenMP of torch's Linux builds, keeps a thread that has finished its share of a parallel
region spinning for a while before it sleeps. A thread still spinning starts the next region at once; one
asleep must be woken (a system call, and on a virtual machine a trip through the hypervisor); but a
spinning thread holds a core that other work, or the run's own next region, may need. Which costs more
depends on the CPU, the hypervisor and the load, so `minigpt train` measures it. libgomp reads the
setting once, as torch loads it, so one process cannot time both: the first `minigpt train` on a machine
(per torch version) starts two probe processes (`python -m minigpt.train.spin`), one per setting, before
it loads torch itself. Each builds the run's model and they take turns timing a few float32 training
steps of it; the median decides, for this run and, through the tuning cache beside decoding's
(`minigpt.generate.engines.tuning.remembered_times`), every later one. The probes are bounded in time
(`SECONDS`, less for a short time budget): if they cannot finish, the run keeps `FALLBACK` and the next run
measures again; so does one that finds the machine busy (a measurement would time the other work). The
probes run while this process waits, before it has loaded anything, so they time nothing of its own.
GOMP_SPINCOUNT set in the environment stands, untried; so does `FALLBACK` for a run on an accelerator, on
one thread, under torchrun, or off Linux (no libgomp to set).
"""

from __future__ import annotations

import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from minigpt.generate.engines.tuning import (
    TORCH_ENV,
    cache_file,
    cores,
    env_threads,
    measuring_blocked,
    remembered_times,
)
from minigpt.train.config import TrainConfig

ENV = "GOMP_SPINCOUNT"
# the settings timed: a short spin, or libgomp's own default count (named, so that it can be forced too)
SPINS = ("10000", "300000")
FALLBACK = "10000"  # unmeasured: the short spin minigpt set before it measured
SECONDS = 8.0  # the probes' bound, their start-up included
SHARE = 0.1  # of a time budget, when that is less
TURN = 3  # steps a probe takes per turn
TURNS = 4  # turns each, the first one untimed (one-off costs)
VOCAB = 96  # the probes' vocabulary: the text's is not read yet (a printable character set's size)
# a probe waits this long after its turn before it reports: its threads' spin runs out first, instead of
# spinning on the cores while the other probe takes its turn (which made the long spin look faster)
SETTLE = 0.1

chosen: dict[str, str] = {}  # this process's choice: "value" and "how", once `choose` has run


class Unmeasured(Exception):
    """The probes could not finish, or this torch's OpenMP is not GNU's."""


def choose(cfg: TrainConfig, processes: int = 1, clock: Callable[[], float] = time.perf_counter) -> None:
    """Set GOMP_SPINCOUNT for this process (before torch loads) to the measured faster setting for runs
    like `cfg` (a command's settings, before the device's recipe fills them), or leave the environment's."""
    if ENV in os.environ:
        chosen.update(value=os.environ[ENV], how="the environment's")
        return
    skip = _why_not(cfg, processes)
    value = FALLBACK
    if skip:
        how = f"not measured: {skip}"
    else:
        measured: list[bool] = []

        def measure() -> dict[str, float]:
            measured.append(True)
            return probe_pair(cfg, clock)

        try:
            best = remembered_times(_key(), list(SPINS), measure, measurements=1)
        except Unmeasured as e:
            how = f"not measured: {e}"
        else:
            name = min(best, key=lambda n: best[n])
            when = (
                "measured on this machine" if measured else f"measured before on this machine: {cache_file()}"
            )
            value, how = name, f"{when}; {_ratio(best)}"
    os.environ[ENV] = value
    chosen.update(value=value, how=how)


def describe() -> str:
    """The spin setting of this process in words, for the run's log."""
    value = chosen.get("value") or os.environ.get(ENV)
    if value is None:
        return "OpenMP spin: libgomp's default (GOMP_SPINCOUNT not set)"
    how = chosen.get("how", "the environment's")
    return f"OpenMP spin {value} ({how})"


def _ratio(best: dict[str, float]) -> str:
    fast, slow = sorted(best, key=lambda n: best[n])
    return f"steps {best[slow] / best[fast]:.2f}x faster than with {slow}"


def _why_not(cfg: TrainConfig, processes: int) -> str | None:
    """Why these runs' spin is not worth measuring (None: it is)."""
    threads = (cfg.threads if cfg.threads is not None else env_threads(TORCH_ENV)) or cores()
    if not sys.platform.startswith("linux"):
        return "no GNU OpenMP off Linux"
    if processes > 1 or "WORLD_SIZE" in os.environ:
        return "several processes"
    if threads < 2:
        return "one thread never waits for another"
    if cfg.device in ("cuda", "mps") or (cfg.device == "auto" and _accelerator()):
        return "the run computes on an accelerator"
    return None


def _accelerator() -> bool:
    """Whether a GPU driver is loaded (NVIDIA's or AMD's), which `--device auto` would train on."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/kfd").exists()


def _key() -> dict[str, object]:
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "unknown"
    return {"train openmp spin": list(SPINS), "torch": torch_version}


def probe_pair(cfg: TrainConfig, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each setting's median seconds per step, from two probe processes taking turns; raises Unmeasured
    when the machine is busy (they would time the other work), when they cannot finish within the bound,
    or when this torch's OpenMP is not GNU's."""
    why = measuring_blocked()
    if why:
        raise Unmeasured(why)
    resolved = replace(cfg.with_recipe("cpu"), dtype="float32", muon_dtype="float32")
    spec = json.dumps({"train": resolved.to_dict(), "vocab_size": VOCAB})
    bound = SECONDS if cfg.max_time is None else min(SECONDS, SHARE * cfg.max_time)
    deadline = clock() + bound
    probes = {value: _start(spec, value) for value in SPINS}
    try:
        for probe in probes.values():
            if _line(probe, deadline, clock) != "ready":
                raise Unmeasured("this torch's OpenMP is not GNU's")
        times: dict[str, list[float]] = {name: [] for name in probes}
        for turn in range(TURNS):
            for name, probe in probes.items():
                assert probe.stdin is not None
                probe.stdin.write(f"{TURN}\n")
                probe.stdin.flush()
                steps = json.loads(_line(probe, deadline, clock))
                times[name] += steps if turn else []
        return {name: statistics.median(t) for name, t in times.items()}
    except (OSError, ValueError) as e:
        raise Unmeasured(f"a probe failed ({e})") from None
    finally:
        for probe in probes.values():
            probe.kill()
            probe.wait()


def _start(spec: str, value: str) -> subprocess.Popen[str]:
    env = {**os.environ, ENV: value}
    return subprocess.Popen(
        [sys.executable, "-m", "minigpt.train.spin", spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip


def _line(probe: subprocess.Popen[str], deadline: float, clock: Callable[[], float]) -> str:
    """The probe's next line, or Unmeasured once `deadline` passes first."""
    assert probe.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(probe.stdout, selectors.EVENT_READ)
        if not selector.select(max(0.0, deadline - clock())):
            raise Unmeasured("the probes did not finish within the time bound")
    line = probe.stdout.readline()
    if not line:
        raise Unmeasured("a probe ended early")
    return line.strip()


def probe(spec: str) -> None:
    """A probe process: announce itself ready once its model is built (or say this OpenMP is not GNU's),
    then for each count N read from stdin take N training steps and write their seconds as JSON."""
    from minigpt.train.tuning import probe_step  # torch: after the environment's setting is in place

    given = json.loads(spec)
    step = probe_step(TrainConfig.from_dict(given["train"]), given["vocab_size"])
    maps = Path("/proc/self/maps")
    gnu = maps.exists() and "libgomp" in maps.read_text(errors="replace")
    print("ready" if gnu else "not gnu", flush=True)
    for line in sys.stdin:
        seconds = []
        for _ in range(int(line)):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        time.sleep(SETTLE)
        print(json.dumps(seconds), flush=True)


if __name__ == "__main__":
    probe(sys.argv[1])
