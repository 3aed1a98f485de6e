"""The dtype 'auto' picks, and the check for a CPU that multiplies bf16 natively."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from minigpt.common import device
from minigpt.common.device import resolve_dtype
from minigpt.errors import UsageError

CPU = torch.device("cpu")


def test_auto_is_float32_on_the_cpu_given_dtypes_stand() -> None:
    """No rule picks bf16 on the CPU: training measures it (tests/test_train_tuning.py)."""
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16  # asked for: given
    with pytest.raises(UsageError, match="float16 is not supported on the CPU"):
        resolve_dtype("float16", CPU)


def test_the_bf16_check_agrees_with_the_kernels_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the reference is Linux's x86 CPU flags")
    flags = set(cpuinfo.read_text().split())
    assert device.cpu_has_bf16() == bool({"avx512_bf16", "amx_tile"} & flags)
