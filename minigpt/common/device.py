"""Turn user-facing device and dtype names ('auto', 'cuda', 'bfloat16', ...) into torch objects (the names
themselves importable without torch, for the command line)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from minigpt.errors import MinigptError, UsageError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' is CUDA, else Apple's MPS, else the CPU; naming an absent accelerator is an error.

    Under torchrun each process takes the GPU of its local rank.
    """
    import torch

    name = name.lower()
    if name not in DEVICES:
        raise UsageError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        else:
            return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise MinigptError("--device cuda: no CUDA GPU is visible to this torch build; use --device cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name == "mps" and not _mps_available():
        raise MinigptError("--device mps: Apple's MPS backend is not available here; use --device cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86's AVX-512 BF16 or AMX tiles); torch's own checks.
    Whether it is also faster than float32 is measured (minigpt.train.tuning)."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on GPUs that support it, float16 on other GPUs, float32 on the CPU (where
    generation decodes faster in float32, and training measures its own: minigpt.train.tuning)."""
    import torch

    name = name.lower()
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MinigptError("--dtype bfloat16: this GPU does not support it; use --dtype float16 or float32")
    if dtype == torch.float16 and device.type == "cpu":
        raise UsageError("--dtype float16 is not supported on the CPU; use bfloat16 or float32")
    return dtype


def autocast_context(device: torch.device, dtype: torch.dtype) -> Any:
    """Mixed precision for the forward pass (weights stay fp32); a no-op for float32."""
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
