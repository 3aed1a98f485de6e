"""What the convert commands take and give: an export's result, the note a run keeps of it, and the settings
of `convert from-hf`, `to-gguf` and `merge` (each field an option of the command), `--overwrite` shared by
all four. Light: no torch, no NumPy, no gguf."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from minigpt.common.settings import setting
from minigpt.errors import MinigptError, UsageError
from minigpt.model.config import GPTConfig
from minigpt.runs.folder import RunDir

__all__ = [
    "GGUF_DTYPES", "ConvertResult", "GGUFConfig", "ImportConfig", "MergeConfig", "OverwriteConfig",
    "record_export",
]  # fmt: skip

GGUF_DTYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote: the directory (or file), the model shape, and a one-line note if any."""

    out: Path
    config: GPTConfig
    params: int
    tokenizer: str
    note: str | None = None  # something the user should know (an export that could not be recorded)


@dataclass(frozen=True)
class GGUFConfig:
    """How `convert to-gguf` stores the weights."""

    dtype: str = setting(
        "f32", "Weight matrices as float32 (exact), float16, or llama.cpp's 8-bit q8_0 (where a row is whole "
        "blocks of 32; float16 otherwise); norms and biases stay float32.", choices=GGUF_DTYPES,
    )  # fmt: skip


@dataclass(frozen=True)
class OverwriteConfig:
    """Whether a convert command may replace what is already where it writes (each command's help says
    what that is: a run, a directory's model files, a file)."""

    overwrite: bool = setting(False, "Replace what is already at OUT.", flags=("--overwrite",))


@dataclass(frozen=True)
class ImportConfig:
    """The tokenizer `convert from-hf` gives the imported run (default: the Hugging Face directory's own)."""

    tokenizer: str | None = setting(
        None, "tiktoken encoding name or .tiktoken file. Default: the directory's own tokenizer.json "
        "(or vocab.json + merges.txt), else for GPT-2 r50k_base from TIKTOKEN_CACHE_DIR.",
    )  # fmt: skip
    tokenizer_file: Path | None = setting(
        None, "The r50k_base.tiktoken ranks file (or another .tiktoken file) to use."
    )

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.tokenizer_file is not None:
            raise UsageError("give --tokenizer or --tokenizer-file, not both")


@dataclass(frozen=True)
class MergeConfig:
    """Where `convert merge` writes the merged run, and where the LoRA run's base is now if it moved."""

    out: Path = setting(MISSING, "The plain run directory to write.")
    base: Path | None = setting(
        None, "Where the base run is now, if it moved (checked by its weights' hash)."
    )


def record_export(run: RunDir, kind: str, out: Path, **details: Any) -> str | None:
    """Note the export in the run's exports.jsonl; a run folder that cannot take the note (read-only,
    say) does not fail the export: the one-line reason comes back instead."""
    try:
        run.record_export(kind, out, **details)
    except MinigptError as e:
        return f"the export is not recorded in the run ({e})"
    return None
