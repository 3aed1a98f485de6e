"""Memory a model will need, estimated from its config before anything is allocated, and what this machine has."""

from __future__ import annotations

import os
from pathlib import Path

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError
from minigpt.params import count_params

FLOAT32 = 4


def available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable on Linux, physical memory elsewhere, None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def inference_bytes(config: GPTConfig, batch: int = 1) -> int:
    """float32 weights plus a full KV cache for `batch` rows (each layer holds its window of positions)."""
    weights = count_params(config).exact_total * FLOAT32
    per_position = 2 * batch * config.kv_heads * config.head_dim * FLOAT32
    kv_cache = per_position * config.cached_positions
    return weights + kv_cache


def training_bytes(config: GPTConfig, batch: int) -> int:
    """Weights, gradients and AdamW's two moments in float32, plus the activations one micro-batch keeps
    for the backward pass (per layer about 34·C + 5·H·T values a token, after Korthikanti et al. 2022,
    and the logits with their gradient)."""
    params = count_params(config).exact_total
    T, C, H, L, V = config.block_size, config.n_embd, config.n_head, config.n_layer, config.vocab_size
    activations = batch * T * (L * (34 * C + 5 * H * T) + 3 * V) * FLOAT32
    return 4 * params * FLOAT32 + activations


def check_fits(needed: int, what: str, fix: str) -> None:
    """Refuse, with the numbers, work that needs more memory than the machine has available."""
    have = available_bytes()
    if have is not None and needed > have:
        raise MinigptError(
            f"{what} needs about {needed / 2**30:,.1f} GiB of memory but {have / 2**30:,.1f} GiB is "
            f"available: {fix}"
        )
