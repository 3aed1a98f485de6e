"""What the convert commands take and give: an export's result, the note a run keeps of it, and the settings
of `convert to-gguf` (each field an option of the command). Light: no torch, no NumPy, no gguf."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.config import GPTConfig
from minigpt.errors import MinigptError
from minigpt.rundir import RunDir
from minigpt.settings import setting

__all__ = ["GGUF_DTYPES", "ConvertResult", "GGUFConfig", "record_export"]

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


def record_export(run: RunDir, kind: str, out: Path, **details: Any) -> str | None:
    """Note the export in the run's exports.jsonl; a run folder that cannot take the note (read-only,
    say) does not fail the export: the one-line reason comes back instead."""
    try:
        run.record_export(kind, out, **details)
    except MinigptError as e:
        return f"the export is not recorded in the run ({e})"
    return None
