"""torchrun support: process-group setup, DDP wrapping and the collective decisions ranks must share."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as td


@dataclass
class DistContext:
    """This process's place in a torchrun job; a single process is rank 0 of 1 and every call is cheap."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls) -> DistContext:
        """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK and join the process group (NCCL on CUDA, Gloo on CPU)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        ctx = cls(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)
        if not td.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(ctx.local_rank % torch.cuda.device_count())
            # a dead peer must end the job in bounded time rather than hang a collective forever
            timeout = datetime.timedelta(seconds=float(os.environ.get("MINIGPT_DIST_TIMEOUT", "120")))
            td.init_process_group(backend=backend, timeout=timeout)
        return ctx

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
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
        """Rank 0 runs the block first (e.g. tokenizing into the cache); the others then read its result."""
        if self.enabled and not self.is_master:
            td.barrier()
        yield
        if self.enabled and self.is_master:
            td.barrier()

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return value
        out = value.detach().clone().float()
        td.all_reduce(out, op=td.ReduceOp.SUM)
        return out / self.world_size

    def any_flag(self, flag: bool) -> bool:
        """True on every rank if it is true on any (a Ctrl-C seen by one rank stops them all together)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._collective_device())
        td.all_reduce(t, op=td.ReduceOp.MAX)
        return bool(t.item())

    def agree_time(self, seconds: float) -> float:
        """Rank 0's clock, broadcast, so that a time budget stops every rank at the same step."""
        if not self.enabled:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self._collective_device())
        td.broadcast(t, src=0)
        return float(t.item())

    def close(self) -> None:
        if self.enabled and td.is_initialized():
            td.destroy_process_group()

    def _collective_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")
