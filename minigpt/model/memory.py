"""Memory: what a config will need, estimated before anything is allocated; what this process can still have;
and, when an allocation fails anyway, the one line that says what it was, how big, and how to need less."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig
from minigpt.model.params import count_params

FLOAT32 = 4
UNLIMITED = 1 << 60  # a cgroup limit this large means none
# values of the additive score's pre-activations materialised at once, unless a single query's row is larger:
# a chunk holds at least one query
SCORE_CHUNK_VALUES = 2**22
# a training step keeps up to this many such tensors alive at once: the recomputed tanh, its gradient and
# the gradient of its input (the backward pass of one chunk), and one to spare: a step's measured peak
# stays below it, an inference's near one
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
    """Memory this process can still take, None if unknown: the least of the system's available memory,
    the address space left under `ulimit -v` (RLIMIT_AS) and the room left in the cgroup's memory limit
    (a container's), since any of them can be what an allocation runs into."""
    limits = [_meminfo_available(), _address_space_left(), _cgroup_left()]
    known = [n for n in limits if n is not None]
    return max(0, min(known)) if known else None


def _meminfo_available() -> int | None:
    """MemAvailable on Linux, physical memory elsewhere."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_left() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        status = Path("/proc/self/status").read_text()
        return soft - int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
    return soft


def _cgroup_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's memory limit less its usage (v2: memory.max, memory.current; v1: memory/...), the page
    cache it could drop (inactive_file) not counted as used, as `docker stats` counts it."""
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    for folder, (limit, usage, cache) in (
        (root, ("memory.max", "memory.current", "inactive_file")),
        (root / "memory", v1),
    ):
        with contextlib.suppress(OSError, ValueError):
            text = (folder / limit).read_text().strip()
            if text == "max" or int(text) >= UNLIMITED:
                return None
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            return int(text) - int((folder / usage).read_text()) + int(stat.get(cache, 0))
    return None


KV_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # by an engine's `kv_cache`


def inference_bytes(config: GPTConfig, batch: int = 1, kv_element: int = FLOAT32) -> int:
    """float32 weights plus a full KV cache for `batch` rows (each layer holds its window of positions, each
    value `kv_element` bytes) and the additive score's chunk."""
    weights = count_params(config).exact_total * FLOAT32
    return weights + kv_cache_bytes(config, batch, kv_element) + score_bytes(config, batch, training=False)


def kv_cache_bytes(
    config: GPTConfig, batch: int = 1, element: int = FLOAT32, capacity: int | None = None
) -> int:
    """Keys and values of `batch` rows over every position each layer keeps (its window, or `capacity` if
    fewer), `element` bytes each."""
    return 2 * batch * config.kv_heads * config.head_dim * element * config.kept_positions(capacity)


def activation_bytes(config: GPTConfig, batch: int) -> int:
    """What one micro-batch keeps for the backward pass: per layer about 34·C + 5·H·T values a token, after
    Korthikanti et al. 2022 (general's mapped queries, additive's W₁q and W₂k on top), and the logits with
    their gradient; and the additive score's chunk, recomputed in the backward pass."""
    T, C, H, L, V = config.block_size, config.n_embd, config.n_head, config.n_layer, config.vocab_size
    score = {"general": C, "additive": 2 * H * config.additive_width}.get(config.attn_score, 0)
    kept = batch * T * (L * (34 * C + 5 * H * T + score) + 3 * V) * FLOAT32
    return kept + score_bytes(config, batch, training=True)


def state_bytes(config: GPTConfig) -> int:
    """Weights, gradients and AdamW's two moments in float32."""
    return 4 * count_params(config).exact_total * FLOAT32


def training_bytes(config: GPTConfig, batch: int) -> int:
    """Weights, gradients and AdamW's two moments in float32, plus one micro-batch's activations."""
    return state_bytes(config) + activation_bytes(config, batch)


def size_text(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def cuda_free_bytes(device: Any) -> int:
    """The free memory of a CUDA GPU as its driver counts it (torch's per-process fraction not applied)."""
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def check_fits(needed: int, what: str, fix: str, device: Any = None) -> None:
    """Refuse, with the numbers, work that needs more memory than the machine has available: the host's,
    or a CUDA GPU's where `device` is one."""
    gpu = getattr(device, "type", "cpu") == "cuda"
    have = cuda_free_bytes(device) if gpu else available_bytes()
    if have is not None and needed > have:
        raise MinigptError(
            f"{what} needs about {needed / 2**30:,.1f} GiB of {'GPU memory' if gpu else 'memory'} but "
            f"{have / 2**30:,.1f} GiB is {'free' if gpu else 'available'}: {fix}"
        )


# ------------------------------------------------------------------------------ when an allocation fails


@dataclass(frozen=True)
class Allocating:
    """What a block of code allocates, in the user's terms: read only if an allocation in it fails."""

    what: str  # "the KV cache for 1,000,000 samples"
    nbytes: int | None = None  # the estimate, for failures that do not say their size (Python's)
    fix: str | None = None  # the option that makes it smaller; None: the command's usual one


_LABEL = "_minigpt_allocating"

# the options that shrink what each command allocates, for failures outside any labelled block
SMALLER = {
    "train": "lower --batch-size (--grad-accum keeps the tokens per step) or --block-size, or pick a smaller "
    "--preset",
    "generate": "lower -s/--num-samples, or load the weights smaller (--dtype bfloat16 or --quantize int8)",
    "eval": "lower --batch-size or --max-windows",
    "serve": "lower --max-batch",
    "attention": "give a shorter text",
    "convert": "free some memory, or convert on a machine with more",
}


def allocating(
    what: str, nbytes: int | None = None, fix: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """Label the allocations inside the block (see `labelled`)."""
    return labelled(Allocating(what, nbytes, fix))


@contextlib.contextmanager
def labelled(label: Allocating) -> Iterator[None]:
    """A failed allocation passing out of the block carries the innermost label to the one place that
    catches it (the CLI, through `allocation_error`). Nothing is caught here."""
    try:
        yield
    except BaseException as e:
        if is_allocation_failure(e) and not hasattr(e, _LABEL):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(e, _LABEL, label)
        raise


def is_allocation_failure(e: BaseException) -> bool:
    """Python's and NumPy's MemoryError, torch's OutOfMemoryError (CUDA, MPS) and its CPU allocator's
    RuntimeError, recognised without importing torch."""
    if isinstance(e, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(e).__mro__):
        return True
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in str(e) or "out of memory" in str(e).lower()
    )


def allocation_error(e: BaseException, command: str | None) -> MinigptError:
    """The one-line error for a failed allocation: what was being allocated, how big, and the option that
    makes it smaller (the label's, else `command`'s usual one)."""
    label: Allocating = getattr(e, _LABEL, None) or Allocating(f"minigpt {command or ''}".strip())
    size, detail = _failed_allocation(e)
    size = size if size is not None else label.nbytes
    amount = size_text(size) if size is not None else "memory (the size was not reported)"
    fix = label.fix or SMALLER.get(command or "", "free some memory")
    detail = f" ({detail})" if detail else ""
    return MinigptError(f"out of memory allocating {amount}{detail} for {label.what}: {fix}")


def _failed_allocation(e: BaseException) -> tuple[int | None, str]:
    """The size of the failed allocation and what it was, as far as the exception says."""
    shape, dtype = getattr(e, "shape", None), getattr(e, "dtype", None)
    if shape is not None and dtype is not None:  # NumPy's _ArrayMemoryError
        return math.prod(shape) * dtype.itemsize, f"an array of shape {tuple(shape)} {dtype}"
    text = str(e)
    device = next((d for d in ("CUDA", "MPS", "XPU") if d in text), None)
    where = f"{device} memory" if device else ("torch's CPU allocator" if "CPUAllocator" in text else "")
    found = re.search(r"allocate (\d+) bytes", text)
    if found:
        return int(found.group(1)), where
    found = re.search(r"[Tt]ried to allocate ([\d.]+) ([KMGTP]i?B|bytes)", text)
    if found:
        units = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
        unit = found.group(2) if found.group(2) in units else found.group(2).replace("B", "iB")
        return round(float(found.group(1)) * units.get(unit, 1)), where
    return None, where
