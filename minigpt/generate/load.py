"""The generation engines (torch, NumPy), which one `minigpt generate` runs, and loading a run into one.

Importing this package imports neither torch nor an engine: `load_engine` imports only the one it needs.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.common import startup
from minigpt.common.files import safetensors_header
from minigpt.errors import MinigptError, UsageError
from minigpt.generate.config import BACKENDS
from minigpt.runs.folder import RunDir

if TYPE_CHECKING:
    from minigpt.generate.config import EngineConfig
    from minigpt.generate.decode import Engine
    from minigpt.tokenizer.base import Tokenizer

__all__ = [
    "NUMPY_DTYPES", "NUMPY_KV_CACHE", "accelerator_visible", "check_samples_fit", "choose_backend",
    "generation_engine", "load_engine",
]  # fmt: skip

NUMPY_DTYPES = ("F32", "F16", "F64")  # safetensors dtypes NumPy can hold; bf16 needs torch
NUMPY_KV_CACHE = "float16"  # the NumPy engine's KV cache where --kv-cache is auto


def accelerator_visible() -> bool:
    """Whether torch may find a GPU here, judged without importing it: Apple silicon (MPS), or the device
    nodes of NVIDIA, AMD (ROCm) or WSL GPU drivers, unless CUDA_VISIBLE_DEVICES hides them all."""
    if sys.platform == "darwin":
        return platform.machine() == "arm64"
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def _numpy_quantizes() -> bool:
    """Whether the NumPy engine runs int8 weights at speed here: through its compiled kernels."""
    from minigpt.generate.engines import kernels

    return kernels.available()


def choose_backend(
    backend: str,
    device: str,
    dtype: str,
    *,
    explain: bool = False,
    weights: Path | None = None,
    quantize: str = "none",
) -> str:
    """'numpy' or 'torch' for `minigpt generate`. auto: NumPy for float32 on the CPU (no accelerator
    visible, or --device cpu), which starts in a fraction of a second, and for int8 weights where its
    compiled kernels run; torch for GPUs, other dtypes, int8 without the kernels, --explain (it reads
    torch's attention) and weights NumPy cannot hold."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    needs_torch = None
    if device in ("cuda", "mps"):
        needs_torch = f"--device {device}"
    elif dtype not in ("auto", "float32"):
        needs_torch = f"--dtype {dtype}"
    elif quantize != "none" and not _numpy_quantizes():
        needs_torch = f"--quantize {quantize}"
    elif explain:
        needs_torch = "--explain"
    if backend == "numpy":
        if needs_torch:
            raise UsageError(
                f"--backend numpy runs float32 on the CPU: drop {needs_torch} or use --backend torch"
            )
        return "numpy"
    if needs_torch or (device == "auto" and accelerator_visible()):
        return "torch"
    if weights is not None and weights.is_file():
        try:
            dtypes = {v["dtype"] for v in safetensors_header(weights).values()}
        except MinigptError:
            return "numpy"  # its loader names the damage
        if not dtypes <= set(NUMPY_DTYPES):
            return "torch"
    return "numpy"


@startup.loading()  # imports, weights and kernels: no collector passes over them (minigpt.common.startup)
def load_engine(
    run_dir: Path,
    backend: str,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    threads: int | None = None,
    kv_cache: str = "auto",
) -> tuple[Engine, Tokenizer]:
    """The engine (best weights, eval mode) and tokenizer of a run directory, for backend 'torch' (on
    `device` in `dtype`, 'auto' resolved as minigpt.common.device does, linear layers in `quantize` form) or
    'numpy' (the CPU in float32), with its weights in the layout its steps run fastest in. CPU threads:
    `threads` fixes them, else the environment does, else each engine chooses them by timing its steps
    (`minigpt.generate.engines.tuning`). `kv_cache`: the KV cache's type, 'auto' as `EngineConfig.kv_cache` says."""
    run = RunDir(run_dir)
    if backend == "torch":
        from minigpt.common.device import resolve_device, resolve_dtype
        from minigpt.generate.engines.torch_engine import TorchEngine
        from minigpt.model.quantize import check_quantize

        torch_device = resolve_device(device)
        check_quantize(quantize, torch_device)
        model, tokenizer, _ = run.load_model(str(torch_device))
        engine = TorchEngine(
            model.to(resolve_dtype(dtype, torch_device)),
            quantize,
            layout="auto",
            threads=threads,
            kv_cache=None if kv_cache == "auto" else kv_cache,
        )
        return engine, tokenizer
    if backend != "numpy":
        raise UsageError(f"unknown backend {backend!r}: choose torch or numpy")
    from minigpt.generate.engines import compiling
    from minigpt.generate.engines.numpy_engine import NumpyEngine

    _, config, tokenizer = run.open()
    unreadable = sorted(run.weight_dtypes() - set(NUMPY_DTYPES))
    if unreadable:
        raise MinigptError(
            f"{run.weights_path} holds {unreadable[0]} tensors, which NumPy cannot read: use --backend torch"
        )
    weights = run.load_weights(config, framework="np")
    # kernels numba's cache lacks are compiled by another process, not before the first token
    engine = NumpyEngine(
        config, weights, layout="auto", threads=threads, quantize=quantize, notice=_say_on_stderr,
        kv_cache=NUMPY_KV_CACHE if kv_cache == "auto" else kv_cache,
        plan=functools.partial(compiling.plan, notice=_say_on_stderr),
    )  # fmt: skip
    return engine, tokenizer


def _say_on_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generation_engine(run_dir: Path, run_on: EngineConfig, explain: bool = False) -> tuple[Engine, Tokenizer]:
    """The engine and tokenizer `generate` and `chat` decode with: the backend `choose_backend` picks for
    `run_on` (--explain needs torch's model), loaded with `load_engine`."""
    if explain and run_on.quantize != "none":
        raise MinigptError("--explain shows the float model's attention: drop --quantize", exit_code=2)
    run = RunDir(run_dir)
    backend = choose_backend(
        run_on.backend, run_on.device, run_on.dtype, explain=explain, weights=run.weights_path,
        quantize=run_on.quantize,
    )  # fmt: skip
    # threads: the engine times its steps on each count, since the best one depends on the CPU and its load;
    # the environment fixes them
    return load_engine(
        run_dir, backend, run_on.device, run_on.dtype, run_on.quantize, kv_cache=run_on.kv_cache
    )


def check_samples_fit(run_dir: Path, engine: Engine, num_samples: int, positions: int) -> None:
    """Refuse, before any is allocated, a KV cache for `num_samples` rows that the memory left cannot hold:
    each layer holds the `positions` a generation reaches (its prompt's and new tokens', as decode sizes
    it), at most its window. The weights are loaded by now, so only the cache and the score's chunk count."""
    from minigpt.model.memory import KV_ELEMENT_BYTES, check_fits, kv_cache_bytes, score_bytes

    if num_samples <= 1:  # one row's cache is part of what loading the weights checked
        return
    config = RunDir(run_dir).model_config()
    cache = kv_cache_bytes(config, num_samples, KV_ELEMENT_BYTES[engine.kv_cache], positions)
    needed = cache + score_bytes(config, num_samples, training=False)
    check_fits(needed, f"{num_samples:,} samples", "lower --num-samples")
