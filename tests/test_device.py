"""The dtype 'auto' picks: bf16 autocast on the CPU only where the CPU multiplies bf16 natively."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from minigpt.common import device
from minigpt.common.device import CPU_BF16_MIN_WIDTH, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_trains_wide_models_in_bf16_only_on_cpus_with_bf16_instructions(
    monkeypatch, native: bool
) -> None:
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: native)
    wide = torch.bfloat16 if native else torch.float32  # emulated bf16 ran 50-500x slower than float32
    assert resolve_dtype("auto", CPU, training_width=CPU_BF16_MIN_WIDTH) == wide
    assert resolve_dtype("auto", CPU, training_width=CPU_BF16_MIN_WIDTH - 64) == torch.float32
    assert resolve_dtype("auto", CPU) == torch.float32  # generation and evaluation
    assert resolve_dtype("bfloat16", CPU, training_width=64) == torch.bfloat16  # asked for: given


def test_the_bf16_check_agrees_with_the_kernels_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the reference is Linux's x86 CPU flags")
    flags = set(cpuinfo.read_text().split())
    assert device.cpu_has_bf16() == bool({"avx512_bf16", "amx_tile"} & flags)
