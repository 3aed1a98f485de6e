"""torchrun support: starting the processes on this machine, process-group setup, DDP wrapping and the
collective decisions ranks must share."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as td

from minigpt.errors import MinigptError, UsageError

TIMEOUT_ENV = "MINIGPT_DIST_TIMEOUT"
# long enough for a torch.compile or a large checkpoint write on one rank while the others wait; a rank that
# dies is noticed by torchrun's agent within a second anyway, this only bounds a rank that hangs alive
DEFAULT_TIMEOUT = 300.0


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait for the other ranks: $MINIGPT_DIST_TIMEOUT seconds, 300 by default."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(
            f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds; unset it or use e.g. 300"
        )
    return datetime.timedelta(seconds=seconds)


@dataclass
class DistContext:
    """This process's place in a torchrun job; a single process is rank 0 of 1 and every call is cheap."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_env(cls, device: str = "auto") -> DistContext:
        """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK and join the process group: NCCL when training on CUDA
        (`device` is the --device name), Gloo on the CPU. Outside torchrun this is rank 0 of 1."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        if "RANK" not in os.environ:
            raise UsageError("WORLD_SIZE is set but RANK is not: start several processes with torchrun")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        ctx = cls(int(os.environ["RANK"]), local_rank, world_size, local_world)
        if td.is_initialized():
            return ctx
        if device == "mps":
            raise UsageError("several processes need CUDA GPUs or the CPU; device mps trains in one process")
        cuda = device in ("auto", "cuda") and torch.cuda.is_available()
        if cuda:
            count = torch.cuda.device_count()
            # one visible GPU per process is fine (a scheduler may bind each rank to its own)
            if 1 < count < local_world:
                raise UsageError(
                    f"{local_world} processes on this machine but {count} CUDA GPUs: "
                    f"use --nproc_per_node {count} (one process per GPU)"
                )
            torch.cuda.set_device(local_rank % count)
        td.init_process_group(backend="nccl" if cuda else "gloo", timeout=collective_timeout())
        return ctx

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model in DistributedDataParallel (it broadcasts rank 0's weights, then averages gradients)."""
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: torch.nn.Module, last: bool) -> Any:
        """Skip the gradient all-reduce on all but the last micro-step of an accumulation."""
        if self.enabled and not last and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def barrier(self) -> None:
        if self.enabled:
            td.barrier()

    @contextlib.contextmanager
    def master_first(self) -> Iterator[None]:
        """Local rank 0 of each machine runs the block first (e.g. tokenizing into that machine's cache); the
        other ranks of the machine then run it and read the result.

        They wait on the rendezvous store rather than in a collective, so tokenizing a large corpus may take
        longer than the collective timeout; if local rank 0 fails, torchrun stops the waiting ranks.
        """
        if not self.enabled:
            yield
            return
        store = _default_store()
        key = f"minigpt/first-done/{self.rank - self.local_rank}"  # the first global rank names the machine
        if store is None:
            if self.local_rank != 0:
                td.barrier()
            yield
            if self.local_rank == 0:
                td.barrier()
            return
        if self.local_rank != 0:
            # polling, not a blocking wait, so that a Ctrl-C or SIGTERM is acted on at once
            try:
                while not store.check([key]):
                    time.sleep(0.05)
            except td.DistError as e:
                raise MinigptError(f"lost contact with the torchrun rendezvous while waiting ({e})") from None
        yield
        if self.local_rank == 0:
            store.set(key, "1")

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return value
        out = value.detach().clone().float()
        td.all_reduce(out, op=td.ReduceOp.SUM)
        return out / self.world_size

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return value
        out = value.detach().clone()
        td.all_reduce(out, op=td.ReduceOp.SUM)
        return out

    def agree_stop(self, flag: bool, *values: float) -> tuple[bool, list[float]]:
        """Whether `flag` is true on any rank (a Ctrl-C seen by one stops them all together), and rank 0's
        `values` (its clock, time reserve, ...), in one collective: one round trip per step. Every rank then
        takes the same time-budget decision at the same step."""
        if not self.enabled:
            return flag, list(values)
        mine = values if self.is_master else (0.0,) * len(values)
        t = torch.tensor([1.0 if flag else 0.0, *mine], dtype=torch.float64, device=self._collective_device())
        td.all_reduce(t, op=td.ReduceOp.SUM)
        total_flags, *master_values = t.tolist()
        return total_flags > 0, master_values

    @contextlib.contextmanager
    def peer_errors(self, run_dir: Path) -> Iterator[None]:
        """Turn a failed collective (another rank died or stopped) into one line instead of a traceback."""
        try:
            yield
        except RuntimeError as e:
            if not self.enabled or not _is_comm_error(e):
                raise
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MinigptError(
                f"rank {self.rank} lost contact with the other training processes ({detail[:200]}); "
                f"another rank probably failed or was stopped; the last checkpoint in {run_dir} is intact"
            ) from None

    def close(self) -> None:
        if self.enabled and td.is_initialized():
            td.destroy_process_group()

    def _collective_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if td.get_backend() == "nccl"
            else torch.device("cpu")
        )


def _default_store() -> Any:
    """The store torchrun's rendezvous gave the process group (None if this torch hides it)."""
    getter = getattr(td.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _is_comm_error(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, td.DistError) or any(
        s in text for s in ("gloo", "nccl", "connection reset", "broken pipe")
    )


def launch_local(nproc: int, args: list[str], command: str = "train") -> int:
    """Run `minigpt COMMAND ARGS` as nproc processes under torch.distributed.run on this machine; its exit
    code.

    The launcher gets its own process group, so a Ctrl-C here reaches it once, and it stops the workers
    (they save and exit); a second Ctrl-C goes to every process, which then exit at once.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "minigpt", command, *args]  # fmt: skip
    proc = subprocess.Popen(cmd, process_group=0, stderr=subprocess.PIPE, text=True, errors="replace")
    relay = threading.Thread(target=_relay_worker_output, args=(proc,), daemon=True)
    relay.start()
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        try:
            if len(received) == 1:
                proc.send_signal(signum)
            else:
                os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
        relay.join(timeout=5)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if code != 0 and not received and not getattr(proc, "reported_error", False):
        print(
            f"error: a training process failed (exit code {code}); run without --nproc to see why",
            file=sys.stderr,
        )
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


_LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")  # torch.distributed.run's own log lines


def _relay_worker_output(proc: Any) -> None:
    """Pass the workers' stderr on, but not the launcher's: its log lines and, once a worker failed, its
    traceback and failure report (the worker already said what went wrong in one line)."""
    quiet = False
    for line in proc.stderr:
        quiet = quiet or line.startswith("Traceback (most recent call last)")
        if quiet or _LAUNCHER_LOG.match(line):
            continue
        if line.startswith("error: "):
            proc.reported_error = True
        sys.stderr.write(line)
        sys.stderr.flush()
