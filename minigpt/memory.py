"""Memory a model will need, estimated from its config before anything is allocated, and what this machine has."""

from __future__ import annotations

import os
from pathlib import Path

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError
from minigpt.params import count_params

FLOAT32 = 4
# values of the additive score's pre-activations materialised at once (16 MiB in float32), unless a single
# query's row is larger: a chunk holds at least one query
SCORE_CHUNK_VALUES = 2**22
# a training step keeps up to this many such tensors alive at once: the recomputed tanh, its gradient and
# the gradient of its input (the backward pass of one chunk); measured, peak RSS grew by 2.3-3.1 chunks
# in training and 1.0-1.2 in inference (a chunk of 16-256 MiB, B 16, H 8, T 256, d_head 16)
_TRAINING_COPIES = 4


def score_chunks(queries: int, keys: int, window: int, per_pair: int) -> list[tuple[int, int, int, int]]:
    """How the additive score materialises its (queries, keys, per_pair) pre-activations: (first query, end,
    first key, end) of each chunk, as many queries as SCORE_CHUNK_VALUES holds (at least one), each over
    only the keys its queries may see (the keys are the latest positions in order, the queries the last of
    them, each seeing itself and the window - 1 positions before it)."""
    rows = _chunk_rows(keys, per_pair)
    return [_chunk(t, rows, queries, keys, window) for t in range(0, queries, rows)]


def _chunk_rows(keys: int, per_pair: int) -> int:
    return max(1, SCORE_CHUNK_VALUES // max(1, keys * per_pair))


def _chunk(first: int, rows: int, queries: int, keys: int, window: int) -> tuple[int, int, int, int]:
    end, offset = min(first + rows, queries), keys - queries
    return first, end, max(0, offset + first - window + 1), offset + end


def score_bytes(config: GPTConfig, batch: int, training: bool) -> int:
    """What the attention score needs beyond the scaled dot product's: for additive, the largest chunk of
    pre-activations `score_chunks` plans over a full block (several copies in training), else nothing.
    Over a full block every chunk reaches back to the first key, so the largest is one of the last two:
    computed from those alone, as a block size from a stranger's config.json may be huge."""
    if config.attn_score != "additive":
        return 0
    T = config.block_size
    per_pair = batch * config.n_head * config.additive_width
    rows = _chunk_rows(T, per_pair)
    last = (T - 1) // rows * rows
    chunks = (_chunk(first, rows, T, T, T) for first in {max(0, last - rows), last})
    largest = max((t1 - t0) * (k1 - k0) for t0, t1, k0, k1 in chunks)
    return largest * per_pair * FLOAT32 * (_TRAINING_COPIES if training else 1)


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
    return weights + kv_cache + score_bytes(config, batch, training=False)


def training_bytes(config: GPTConfig, batch: int) -> int:
    """Weights, gradients and AdamW's two moments in float32, plus the activations one micro-batch keeps
    for the backward pass (per layer about 34·C + 5·H·T values a token, after Korthikanti et al. 2022,
    and the logits with their gradient; general's mapped queries, additive's W₁q and W₂k on top) and the
    additive score's chunk."""
    params = count_params(config).exact_total
    T, C, H, L, V = config.block_size, config.n_embd, config.n_head, config.n_layer, config.vocab_size
    score = {"general": C, "additive": 2 * H * config.additive_width}.get(config.attn_score, 0)
    activations = batch * T * (L * (34 * C + 5 * H * T + score) + 3 * V) * FLOAT32
    return 4 * params * FLOAT32 + activations + score_bytes(config, batch, training=True)


def check_fits(needed: int, what: str, fix: str) -> None:
    """Refuse, with the numbers, work that needs more memory than the machine has available."""
    have = available_bytes()
    if have is not None and needed > have:
        raise MinigptError(
            f"{what} needs about {needed / 2**30:,.1f} GiB of memory but {have / 2**30:,.1f} GiB is "
            f"available: {fix}"
        )
