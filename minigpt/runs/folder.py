"""The run folder: the one module that knows its file names and how each file is read and written.

    config.json           model shape, tokenizer kind, training and data settings, metrics
    tokenizer.json        the whole tokenizer, in Hugging Face's format (minigpt.tokenizer.hf)
    tokenizer_config.json what transformers' AutoTokenizer needs beside it
    model.safetensors     the best-validation weights (what generate, eval, params and convert read)
    adapter.safetensors   a LoRA run's best adapter, in place of model.safetensors: applied to the base
                          run config.json names (and refused on any other: its header holds the base's hash)
    state.safetensors     latest weights + optimizer moments + resume state (JSON metadata)
    metrics.jsonl         every logged step and evaluation
    (RunDir.CARD)         the model card under Hugging Face's name for it (minigpt.runs.model_card),
                          rewritten at every save
    exports.jsonl         one record per export (convert to-hf, to-gguf): format, where, when

Safetensors and JSON only, every write atomic; importable without torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shlex
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from minigpt import __version__
from minigpt.common.files import (
    atomic_paths,
    atomic_write_bytes,
    atomic_write_json,
    json_bytes,
    load_tensors,
    make_dir,
    read_bounded,
    read_json,
    remove_stale_temps,
    safetensors_header,
    safetensors_metadata,
    save_tensors,
    to_json,
    write_tensors,
)
from minigpt.common.strict_json import JsonError, parse_json
from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig
from minigpt.model.lora import (
    LoRAConfig,
    adapter_metadata,
    base_config,
    check_adapter_shapes,
    check_base,
    file_sha256,
    merge,
    read_adapter_metadata,
)
from minigpt.model.memory import allocating, check_fits, inference_bytes
from minigpt.model.weights import check_shapes
from minigpt.runs.usage import example_prompt, generate_command

if TYPE_CHECKING:
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.tokenizer.base import Tokenizer

FORMAT = "minigpt-run"
STATE_FORMAT = "minigpt-state"
DEFAULT_ROOT = Path("checkpoints")


class RunDir:
    """A run directory written by `minigpt train` (or `convert from-hf`), read and written by name."""

    CONFIG = "config.json"
    TOKENIZER = "tokenizer.json"
    TOKENIZER_CONFIG = "tokenizer_config.json"
    WEIGHTS = "model.safetensors"
    STATE = "state.safetensors"
    METRICS = "metrics.jsonl"
    ADAPTER = "adapter.safetensors"  # a LoRA run's, in place of WEIGHTS
    CARD = "README.md"  # the model card, under the name the Hugging Face hub reads it by
    EXPORTS = "exports.jsonl"
    # what a save writes (exports.jsonl is not the run changing: `modified` leaves it out)
    FILES = (CONFIG, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS, STATE, METRICS, CARD)

    def __init__(self, path: Path | str, base: Path | None = None) -> None:
        self.path = Path(path)
        self.base_override = base  # a LoRA run's base run, when not where config.json says
        self._tokenizer_written: tuple[Tokenizer, int] | None = None  # (tokenizer, block_size) last saved

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.TOKENIZER

    @property
    def weights_path(self) -> Path:
        return self.path / self.WEIGHTS

    @property
    def adapter_path(self) -> Path:
        return self.path / self.ADAPTER

    @property
    def state_path(self) -> Path:
        return self.path / self.STATE

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    # --- finding runs -----------------------------------------------------------------------------------

    @classmethod
    def latest(cls, root: Path = DEFAULT_ROOT, name_one: str = "") -> RunDir:
        """The run under root that changed last (trained, resumed or converted) and has weights; `name_one`
        says how the asking command takes a run instead (e.g. "pass --model DIR"), for the error."""
        root = Path(root)
        found = (
            [p for name in (cls.WEIGHTS, cls.ADAPTER) for p in root.glob(f"*/{name}")]
            if root.is_dir()
            else []
        )
        runs = [cls(p.parent) for p in found]
        if not runs:
            instead = f", or {name_one}" if name_one else ""
            raise MinigptError(f"no trained model under {root}/: run `minigpt train FILE` first{instead}")
        return max(runs, key=lambda r: r.modified())

    def modified(self) -> float:
        """When any of the run's files last changed (config.json is rewritten at every evaluation)."""
        times = [
            p.stat().st_mtime for p in (self.path / n for n in (*self.FILES, self.ADAPTER)) if p.is_file()
        ]
        return max(times, default=0.0)

    # --- reading ----------------------------------------------------------------------------------------

    def read_config(self) -> dict[str, Any]:
        """config.json, checked to be minigpt's."""
        if not self.path.exists():
            raise MinigptError(f"{self} does not exist: pass a run directory written by `minigpt train`")
        if self.path.is_file():
            raise MinigptError(f"{self} is a file: pass the run directory that holds it")
        if not self.config_path.exists():
            raise MinigptError(f"{self} has no {self.CONFIG}: it is not a minigpt run directory")
        data = read_json(self.config_path)
        if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
            raise MinigptError(f"{self.config_path} is not a minigpt run config (no format '{FORMAT}')")
        return data

    def model_config(self, data: dict[str, Any] | None = None) -> GPTConfig:
        """The model shape config.json describes (`data`: config.json already read), checked against the
        weights file's header when the run has one: every command that opens a run gets its shape here."""
        data = self.read_config() if data is None else data
        try:
            config = GPTConfig.from_dict(data["model"])
        except (TypeError, MinigptError) as e:
            raise MinigptError(f"{self.config_path}: invalid model config ({e})") from None
        if self.weights_path.exists() or self.weights_path.is_symlink():
            self.check_weights(config)
        return config

    def check_weights(self, config: GPTConfig) -> None:
        """Refuse, in one line, a config that does not describe the tensors the weights file holds: names
        and shapes from its header, no tensor read (a config.json edited to 65,536 wide would otherwise
        be counted, estimated and allocated as if its weights were)."""
        shapes = {k: tuple(v["shape"]) for k, v in self.weights_header().items()}
        check_shapes(config, shapes, self.weights_path)

    def tokenizer(self) -> Tokenizer:
        from minigpt.tokenizer.load import load_tokenizer_file

        if not self.tokenizer_path.exists():
            raise MinigptError(f"{self} has no {self.TOKENIZER}: the run is incomplete")
        return load_tokenizer_file(self.tokenizer_path)

    def open(self) -> tuple[dict[str, Any], GPTConfig, Tokenizer]:
        """config.json, model config and tokenizer, checked to fit together (no torch)."""
        data = self.read_config()
        config = self.model_config(data)
        tokenizer = self.tokenizer()
        if tokenizer.vocab_size > config.vocab_size:
            raise MinigptError(
                f"{self}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
            )
        return data, config, tokenizer

    def weights_header(self) -> dict[str, dict[str, Any]]:
        """Name, dtype and shape of every stored weight, read from the header alone (a LoRA run's: its
        base's and its adapter's)."""
        link = self.adapter_link()
        if link is None:
            return safetensors_header(self.weights_path)
        return {**self._base(link).weights_header(), **safetensors_header(self.adapter_path)}

    def weight_dtypes(self) -> set[str]:
        return {v["dtype"] for v in self.weights_header().values()}

    def stored_param_count(self) -> int:
        """Number of parameters the stored weights give the model (a tied tensor is stored once; a LoRA run's
        base with its new rows: the merged model's)."""
        header = self.weights_header()
        return sum(math.prod(v["shape"]) for k, v in header.items() if not k.endswith(("lora_A", "lora_B")))

    # --- LoRA runs: an adapter on a base run -------------------------------------------------------------

    def adapter_link(self, data: dict[str, Any] | None = None) -> AdapterLink | None:
        """A LoRA run's base, base hash and adapter settings (config.json's adapter section), else None."""
        data = self.read_config() if data is None else data
        if "adapter" not in data:
            return None
        section = data["adapter"]
        base = section.get("base") if isinstance(section, dict) else None
        sha = section.get("base_sha256") if isinstance(section, dict) else None
        if not isinstance(base, str) or not isinstance(sha, str):
            raise MinigptError(f"{self.config_path}: the adapter section is damaged (no base run or hash)")
        lora = LoRAConfig.from_json(section.get("lora"), self.config_path)
        return AdapterLink(self.base_override or Path(base), sha, lora)

    def _base(self, link: AdapterLink) -> RunDir:
        base = RunDir(link.base)
        if not base.config_path.is_file():
            raise MinigptError(
                f"the base run {link.base} of the LoRA run {self} is not there: restore it, give it with "
                f"--base, or merge the adapter into a plain run (minigpt convert merge) while it is there"
            )
        if base.adapter_link() is not None:
            raise MinigptError(f"{link.base} is itself a LoRA run: merge it first (minigpt convert merge)")
        return base

    def base_weights(
        self, config: GPTConfig, link: AdapterLink, framework: Literal["pt", "np"] = "pt"
    ) -> dict[str, Any]:
        """The base run's weights, checked to be the ones the adapter was trained on."""
        base = self._base(link)
        shape = base_config(config, link.lora)
        if base.model_config().to_dict() | {"dropout": 0.0} != shape.to_dict() | {"dropout": 0.0}:
            raise MinigptError(f"{link.base} does not hold the model {self} adapts (another shape)")
        check_base(file_sha256(base.weights_path), link.base_sha256, base.path, self.adapter_path)
        return base.load_weights(shape, framework)

    def load_adapter(
        self, config: GPTConfig, link: AdapterLink, framework: Literal["pt", "np"] = "pt"
    ) -> dict[str, Any]:
        """The adapter's tensors, checked against its settings and its base."""
        shapes = {k: tuple(v["shape"]) for k, v in safetensors_header(self.adapter_path).items()}
        check_adapter_shapes(config, link.lora, shapes, self.adapter_path)
        tensors, meta = load_tensors(self.adapter_path, framework)
        lora, sha = read_adapter_metadata(meta, self.adapter_path)
        if lora != link.lora or sha != link.base_sha256:
            raise MinigptError(
                f"{self.adapter_path} and {self.config_path} describe different adapters: restore the run"
            )
        _check_finite(tensors, self.adapter_path)
        return tensors

    def load_weights(self, config: GPTConfig, framework: Literal["pt", "np"] = "pt") -> dict[str, Any]:
        """The best weights as torch tensors or NumPy arrays, checked against `config`'s names and shapes; a
        LoRA run's are its base's with the adapter merged in."""
        link = self.adapter_link()
        if link is not None:
            base = self.base_weights(config, link, framework)
            adapter = self.load_adapter(config, link, framework)
            return merge(base, adapter, link.lora, _concatenate(framework))
        self.check_weights(config)
        needed = inference_bytes(config)
        check_fits(needed, f"the model in {self}", "use a smaller model")
        with allocating(f"the weights in {self.weights_path}", needed):
            tensors, _ = load_tensors(self.weights_path, framework)
        check_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, self.weights_path)
        _check_finite(tensors, self.weights_path)
        return tensors

    def load_model(self, device: str = "cpu") -> tuple[GPT, Tokenizer, dict[str, Any]]:
        """Model (best weights, eval mode), tokenizer and config.json."""
        from minigpt.model.build import build_model

        data, config, tokenizer = self.open()
        model = build_model(config, self.load_weights(config), self.weights_path, device)
        model.eval()
        return model, tokenizer, data

    def has_state(self) -> bool:
        return self.state_path.is_file()

    def checkpoint_step(self) -> int | None:
        """The step the resumable state on disk holds, from its header (None: no readable state)."""
        if not self.has_state():
            return None
        try:
            return int(safetensors_metadata(self.state_path)["step"])
        except (MinigptError, KeyError, ValueError):
            return None

    def load_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The training state's tensors and metadata, checked to be a minigpt training state."""
        tensors, meta = load_tensors(self.state_path)
        if meta.get("format") != STATE_FORMAT:
            raise MinigptError(f"{self.state_path} is not a minigpt training state")
        return tensors, meta

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl; a torn last line from a crash, or any line that is not a record
        with a kind and a step, is skipped (with a warning on stderr if it was not the last)."""
        records, lines = self._metrics_lines()
        skipped = len(lines) - len(records)
        if skipped > (0 if lines and _metrics_record(lines[-1]) else 1):
            print(f"warning: skipped {skipped} unreadable line(s) of {self.metrics_path}", file=sys.stderr)
        return records

    def _metrics_lines(self) -> tuple[list[dict[str, Any]], list[str]]:
        if not self.metrics_path.exists() and not self.metrics_path.is_symlink():
            return [], []
        lines = read_bounded(self.metrics_path).decode("utf-8", errors="replace").splitlines()
        return [r for r in map(_metrics_record, lines) if r is not None], lines

    # --- writing ----------------------------------------------------------------------------------------

    def guard_new(self, overwrite: bool, remedy: str = "") -> None:
        """Refuse to write a new run over an existing one unless told to (resume has its own path);
        `remedy` says what to do instead in the asking command's options (default: `train`'s)."""
        if self.path.exists() and not self.path.is_dir():
            raise MinigptError(f"{self} exists and is not a directory: choose another --out")
        if self.path.is_dir() and any(self.path.iterdir()) and not overwrite:
            remedy = remedy or f"resume it with --resume {self}, choose another --out, or pass --overwrite"
            raise MinigptError(f"{self} already holds a run: {remedy}")

    def clear(self, names: tuple[str, ...] = (WEIGHTS, STATE, METRICS)) -> None:
        """Remove these run files, so an overwritten or converted run keeps nothing of the old one."""
        for name in names:
            (self.path / name).unlink(missing_ok=True)

    def save(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        extra: dict[str, Any],
        save_weights: bool = True,
        weights_metadata: dict[str, str] | None = None,
    ) -> None:
        """Write (or refresh) config.json, the model card and, optionally, the best weights (with
        `weights_metadata` in their header) and the tokenizer files. The weights and config.json land
        together: both are written in full, then renamed into place one right after the other.

        The tokenizer files come with the weights, not before: a run without weights loads nowhere, and
        a large vocabulary's tokenizer.json (GPT-2's 50,000 merges) takes long enough to build that a
        run's first step would otherwise wait for it."""
        from minigpt.model.build import model_tensors
        from minigpt.tokenizer.hf import tokenizer_config, tokenizer_json

        make_dir(self.path)
        remove_stale_temps(self.path)
        if save_weights and not self._tokenizer_files_hold(tokenizer, model.config.block_size):
            atomic_write_json(self.tokenizer_path, tokenizer_json(tokenizer))
            atomic_write_json(
                self.path / self.TOKENIZER_CONFIG, tokenizer_config(tokenizer, model.config.block_size)
            )
            self._tokenizer_written = (tokenizer, model.config.block_size)
        config = {
            "format": FORMAT,
            "minigpt_version": __version__,
            "model": model.config.to_dict(),
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size},
            **extra,
        }
        weights, metadata = self.weights_path, {**(weights_metadata or {}), "format": FORMAT}
        if model.lora is not None:  # a LoRA run saves its adapter, tied to the base by its hash
            weights, link = self.adapter_path, extra["adapter"]
            metadata = adapter_metadata(model.lora, link["base_sha256"], int(metadata.get("step", 0)))
        targets = [weights, self.config_path] if save_weights else [self.config_path]
        with atomic_paths(*targets) as temps:
            if save_weights:
                write_tensors(temps[0], model_tensors(model), metadata=metadata)
            temps[-1].write_bytes(json_bytes(config))
        self._write_card(config, model, tokenizer)

    def _tokenizer_files_hold(self, tokenizer: Tokenizer, block_size: int) -> bool:
        """Whether this object wrote these tokenizer files for this tokenizer (tokenizers are immutable)
        and they are still there: a run's later checkpoints skip rebuilding the same bytes, which for a
        large vocabulary would cost every save."""
        written = self._tokenizer_written
        if written is None or written[0] is not tokenizer or written[1] != block_size:
            return False
        files = [self.path / name for name in (self.TOKENIZER, self.TOKENIZER_CONFIG)]
        return all(f.is_file() and not f.is_symlink() for f in files)

    def _write_card(self, config: dict[str, Any], model: GPT, tokenizer: Tokenizer) -> None:
        """The model card, CARD (minigpt.runs.model_card.write_card: a card of the user's own stays)."""
        from minigpt.runs.model_card import model_card, write_card

        name, run = self.path.name, str(self.path)  # the path as given: the commands work where it was given
        convert = [shlex.join(["minigpt", "convert", kind, run, f"{run}{suffix}"]) for kind, suffix in
                   (("to-hf", "-hf"), ("to-gguf", ".gguf"))]  # fmt: skip
        usage = (
            f"```bash\n{generate_command(self.path, example_prompt(tokenizer))}\n"
            f"{convert[0]}      # transformers\n{convert[1]}  # llama.cpp\n```\n\n"
            f"`AutoTokenizer.from_pretrained({json.dumps(run)})` loads the tokenizer as it is here."
        )
        write_card(
            self.path / self.CARD,
            lambda license: model_card(
                name, config, model.config, tokenizer.describe(), model.num_params(),
                made_by=_made_by(config), usage=usage, license=license,
            ),
        )  # fmt: skip

    def save_state(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """The resumable training state as one atomic safetensors file."""
        save_tensors(self.state_path, tensors, metadata={"format": STATE_FORMAT, **metadata})

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl (a torn last line from a crash is skipped on reading)."""
        _append_line(self.metrics_path, record)

    def record_export(self, kind: str, path: Path, **details: Any) -> None:
        """Note in exports.jsonl that the run was exported as `kind` ("hf", "gguf") to `path`."""
        record = {"format": kind, "path": str(Path(path).resolve()), "time": time.time(), **details}
        _append_line(self.path / self.EXPORTS, record)

    def exports(self) -> list[dict[str, Any]]:
        """Every export recorded in exports.jsonl (unreadable lines skipped), oldest first."""
        path = self.path / self.EXPORTS
        if not path.is_file():
            return []
        records = []
        for line in read_bounded(path).decode("utf-8", errors="replace").splitlines():
            try:
                record = parse_json(line)
            except JsonError:
                continue
            if isinstance(record, dict) and isinstance(record.get("format"), str):
                records.append(record)
        return records

    def rewind_metrics(self, step: int) -> list[dict[str, Any]]:
        """Drop the records logged after `step` (the checkpoint a resume starts from), so a run that crashed
        after its last save does not log those steps twice, and any unreadable line; returns the records."""
        records, lines = self._metrics_lines()
        kept = [r for r in records if r["step"] <= step]
        if len(kept) < len(lines):  # also drops unreadable lines, which would otherwise warn at every read
            atomic_write_bytes(self.metrics_path, "".join(to_json(r) + "\n" for r in kept).encode("utf-8"))
        return kept

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive lock on the run for as long as it is written: a second writer gets a one-line
        error. The kernel drops the lock when the process dies, so kill -9 leaves no stale lock."""
        import fcntl

        make_dir(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)  # the folder itself: no lock file to leave
        except OSError as e:
            raise MinigptError(f"cannot lock {self} ({e.strerror})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MinigptError(
                    f"{self} is being written by another minigpt process: wait for it to finish, or "
                    f"choose another --out"
                ) from None
            yield
        finally:
            os.close(fd)


def _append_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line to a run's log file, never through a symbolic link: a run folder from elsewhere
    must not make us write outside it."""
    line = (to_json(record) + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise MinigptError(f"cannot append to {path}: {why}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MinigptError(f"{path} is not a regular file: remove it")
        os.write(fd, line)
    except OSError as e:
        raise MinigptError(f"cannot append to {path} ({e.strerror})") from None
    finally:
        os.close(fd)


def _made_by(config: dict[str, Any]) -> str:
    """How the run came to be, for its model card."""
    source = config.get("source")
    if isinstance(source, dict):
        return f"`minigpt convert from-hf` of a Hugging Face {source.get('model_type', '?')} model"
    return "`minigpt train`"


def _metrics_record(line: str) -> dict[str, Any] | None:
    try:
        record = parse_json(line)
    except JsonError:
        return None
    ok = (
        isinstance(record, dict)
        and isinstance(record.get("kind"), str)
        and isinstance(record.get("step"), int)
    )
    return record if ok else None


class AdapterLink(NamedTuple):
    """What a LoRA run's config.json says of its adapter: the base run, its weights' sha256, the settings."""

    base: Path
    base_sha256: str
    lora: LoRAConfig


def _concatenate(framework: str) -> Any:
    """Row concatenation for torch tensors or NumPy arrays."""
    if framework == "pt":
        import torch

        return torch.cat
    import numpy as np

    return np.concatenate


def _check_finite(tensors: dict[str, Any], source: Path) -> None:
    bad = next((name for name, t in tensors.items() if not _all_finite(t)), None)
    if bad is not None:  # sampling and attention views cannot work on NaN: say so here, once
        raise MinigptError(
            f"{source} holds NaN or infinite weights ({bad}): the run diverged or the file is "
            f"damaged; retrain or restore it"
        )


def _all_finite(tensor: Any) -> bool:
    """Whether a torch tensor or NumPy array holds only finite numbers (without importing torch for NumPy)."""
    if hasattr(tensor, "isfinite"):
        return bool(tensor.isfinite().all())
    import numpy as np

    return bool(np.isfinite(tensor).all())
