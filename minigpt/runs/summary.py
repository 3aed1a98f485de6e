"""What runs exist and how each was made: one summary per run folder, read from its files (no torch)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minigpt.errors import MinigptError
from minigpt.runs.folder import DEFAULT_ROOT, RunDir
from minigpt.runs.model_card import data_label, settings_line


@dataclass(frozen=True)
class RunSummary:
    """One run at a glance: what it learned from, its shape and how far training got."""

    path: str
    data: str  # the input files' names, or where converted weights came from
    tokenizer: str
    shape: str  # layers x heads x width, context
    arch: str  # what differs from GPT-2 (GPTConfig.architecture)
    params: int
    steps: int | None  # None: not trained by minigpt (converted)
    tokens: int | None
    best_val_loss: float | None
    best_val_bpb: float | None
    elapsed: float | None  # seconds of training
    modified: float  # when the run last changed (seconds since the epoch)
    settings: str  # the training recipe in one line
    exports: list[str]  # the formats the run was exported to ("hf", "gguf"), each once, oldest first

    @property
    def age(self) -> float:
        return max(0.0, time.time() - self.modified)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "age_seconds": round(self.age, 1)}


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def summarize(run: RunDir) -> RunSummary:
    """A run's summary from config.json and the weights header; a damaged run is a MinigptError."""
    data = run.read_config()
    config = run.model_config(data)
    metrics = data.get("metrics") or {}
    last = metrics.get("last") or {}
    tok = data.get("tokenizer") or {}
    return RunSummary(
        path=str(run),
        data=data_label(data),
        tokenizer=f"{tok.get('kind', '?')} ({config.vocab_size:,})",
        shape=f"{config.n_layer}x{config.n_head}x{config.n_embd}, ctx {config.block_size}",
        arch=config.architecture,
        params=run.stored_param_count(),
        steps=last.get("step") if isinstance(last.get("step"), int) else None,
        tokens=last.get("tokens") if isinstance(last.get("tokens"), int) else None,
        best_val_loss=_finite(metrics.get("best_val_loss")),
        best_val_bpb=_finite(metrics.get("best_val_bpb")),
        elapsed=_finite(last.get("elapsed")),
        modified=run.modified(),
        settings=settings_line(data.get("train") or {}, metrics),
        exports=list(dict.fromkeys(e["format"] for e in run.exports())),
    )


def list_runs(root: Path = DEFAULT_ROOT) -> tuple[list[RunSummary], list[str]]:
    """Every run under root, newest first, and a one-line problem for each folder that is not readable."""
    root = Path(root)
    if not root.is_dir():
        raise MinigptError(f"{root} is not a directory: pass the folder that holds your runs")
    summaries, problems = [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        run = RunDir(folder)
        if not run.config_path.is_file():
            continue
        try:
            summaries.append(summarize(run))
        except MinigptError as e:
            problems.append(str(e))
    summaries.sort(key=lambda s: s.modified, reverse=True)
    return summaries, problems
