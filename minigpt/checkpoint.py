"""Run directories on disk: atomic writes, safetensors weights, JSON config, no pickle anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt import __version__
from minigpt.config import GPTConfig
from minigpt.errors import MinigptError

if TYPE_CHECKING:
    import torch

    from minigpt.model import GPT
    from minigpt.tokenizer import Tokenizer

FORMAT = "minigpt-run"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"  # best-validation weights: what generate, eval and params read
STATE_FILE = "state.safetensors"  # latest weights + optimizer moments + resume state (JSON header)
METRICS_FILE = "metrics.jsonl"
DEFAULT_ROOT = Path("checkpoints")


def _fsync_dir(directory: Path) -> None:
    # the rename itself must reach the disk, or a power cut can undo it
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync it and rename it over `path`.

    A crash or Ctrl-C at any moment leaves either the old file or the new one, never a mix.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_stale_temps(directory: Path) -> None:
    """Delete temp files a killed writer left behind (the files they were replacing are intact)."""
    for tmp in Path(directory).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (a torn last line from a crash is skipped by `read_jsonl`)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    if not Path(path).exists():
        return records
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors as safetensors, atomically."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(cpu, str(tmp), metadata=metadata)


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file and its metadata; a damaged file is a MinigptError."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise MinigptError(f"{path} is missing: is this a complete minigpt run directory?")
    try:
        tensors = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = f.get_tensor(key)
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise MinigptError(
            f"{path} is corrupt or not a safetensors file ({e}); retrain or restore it"
        ) from None
    return tensors, metadata


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor's entry in a safetensors header ('dtype', 'shape', ...), without torch or the data."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for v in entries.values():
            v["dtype"], v["shape"] = str(v["dtype"]), [int(d) for d in v["shape"]]
        return entries
    except FileNotFoundError:
        raise MinigptError(f"{path} is missing: is this a complete minigpt run directory?") from None
    except (ValueError, KeyError, TypeError, AttributeError, struct.error, json.JSONDecodeError) as e:
        raise MinigptError(f"{path} is corrupt or not a safetensors file ({e})") from None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header, without torch and without reading the data."""
    return {k: v["shape"] for k, v in safetensors_header(path).items()}


def stored_param_count(path: Path) -> int:
    """Number of parameters stored in a weights file (a tied tensor is stored once)."""
    total = 0
    for shape in safetensors_shapes(path).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def model_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state dict with GPT-2 names, the tied head left out (it is wte)."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor a run's weights file holds for `config` (the tied head left out),
    worked out without torch; a test holds it to `model_tensors(GPT(config))`."""
    C, V = config.n_embd, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (V, C),
        "transformer.wpe.weight": (config.block_size, C),
    }
    linears = {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (config.d_ff, C)}
    linears["mlp.c_proj"] = (C, config.d_ff)
    for i in range(config.n_layer):
        for norm in ("ln_1", "ln_2"):
            shapes[f"transformer.h.{i}.{norm}.weight"] = (C,)
            if config.bias:
                shapes[f"transformer.h.{i}.{norm}.bias"] = (C,)
        for name, shape in linears.items():
            shapes[f"transformer.h.{i}.{name}.weight"] = shape
            if config.bias:
                shapes[f"transformer.h.{i}.{name}.bias"] = shape[:1]
    shapes["transformer.ln_f.weight"] = (C,)
    if config.bias:
        shapes["transformer.ln_f.bias"] = (C,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def check_shapes(config: GPTConfig, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    """Stored tensor names and shapes must be exactly what the config describes (a one-line error)."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in expected if k in shapes and tuple(shapes[k]) != expected[k])
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}")
        if wrong:
            k = wrong[0]
            parts.append(f"{k} has shape {list(shapes[k])}, config says {list(expected[k])}")
        raise MinigptError(f"{source} does not match its config.json ({'; '.join(parts)})")


def build_model(
    config: GPTConfig, tensors: dict[str, torch.Tensor], source: Path, device: str = "cpu"
) -> GPT:
    """Build a GPT from stored tensors, checking names and shapes, without a wasted random init."""

    from minigpt.model import GPT

    check_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    model = GPT.uninitialized(config)
    state = {k: v.float() for k, v in tensors.items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model.to(device)


def read_json(path: Path) -> Any:
    """A JSON file's content; unreadable JSON is a one-line MinigptError naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MinigptError(f"{path} is corrupt ({e})") from None


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.json, checked to be minigpt's."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise MinigptError(f"{run_dir} does not exist: pass a run directory written by `minigpt train`")
    if run_dir.is_file():
        raise MinigptError(f"{run_dir} is a file: pass the run directory that holds it")
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise MinigptError(f"{run_dir} has no {CONFIG_FILE}: it is not a minigpt run directory")
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
        raise MinigptError(f"{path} is not a minigpt run config (no format '{FORMAT}')")
    return data


def run_model_config(data: dict[str, Any], source: Path) -> GPTConfig:
    try:
        return GPTConfig.from_dict(data["model"])
    except (TypeError, MinigptError) as e:
        raise MinigptError(f"{source}: invalid model config ({e})") from None


def load_tokenizer(run_dir: Path) -> Tokenizer:
    from minigpt.tokenizer import tokenizer_from_json

    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise MinigptError(f"{run_dir} has no {TOKENIZER_FILE}: the run is incomplete")
    data = read_json(path)
    return tokenizer_from_json(data)


def open_run(run_dir: Path) -> tuple[dict[str, Any], GPTConfig, Tokenizer]:
    """config.json, model config and tokenizer of a run directory, checked to fit together (no torch)."""
    run_dir = Path(run_dir)
    data = read_run_config(run_dir)
    config = run_model_config(data, run_dir / CONFIG_FILE)
    tokenizer = load_tokenizer(run_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise MinigptError(
            f"{run_dir}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    return data, config, tokenizer


def load_run(run_dir: Path, device: str = "cpu") -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """Model (best weights, eval mode), tokenizer and config.json of a run directory."""
    data, config, tokenizer = open_run(run_dir)
    tensors, _ = load_tensors(Path(run_dir) / WEIGHTS_FILE)
    model = build_model(config, tensors, Path(run_dir) / WEIGHTS_FILE, device)
    model.eval()
    return model, tokenizer, data


def save_run_files(
    run_dir: Path,
    model: GPT,
    tokenizer: Tokenizer,
    extra: dict[str, Any],
    save_weights: bool = True,
) -> None:
    """Write (or refresh) config.json, tokenizer.json and, optionally, the best weights."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(run_dir)
    if save_weights:
        save_tensors(run_dir / WEIGHTS_FILE, model_tensors(model), metadata={"format": FORMAT})
    atomic_write_json(run_dir / TOKENIZER_FILE, tokenizer.to_json())
    config = {
        "format": FORMAT,
        "minigpt_version": __version__,
        "model": model.config.to_dict(),
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size},
        **extra,
    }
    atomic_write_json(run_dir / CONFIG_FILE, config)


def latest_run(root: Path = DEFAULT_ROOT) -> Path:
    """The most recently written run directory under root."""
    root = Path(root)
    runs = [p.parent for p in root.glob(f"*/{WEIGHTS_FILE}")] if root.is_dir() else []
    if not runs:
        raise MinigptError(
            f"no trained model under {root}/: run `minigpt train FILE` first or pass --model DIR"
        )
    return max(runs, key=lambda p: (p / WEIGHTS_FILE).stat().st_mtime)


def guard_new_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse to write into an existing run unless told to (resume goes through its own path)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise MinigptError(f"{run_dir} exists and is not a directory: choose another --out")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not overwrite:
        raise MinigptError(
            f"{run_dir} already holds a run: resume it with --resume {run_dir}, "
            f"choose another --out, or pass --overwrite"
        )
