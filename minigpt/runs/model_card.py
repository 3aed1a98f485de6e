"""Model cards for run folders and exports: what the model is, what it learned from, how it was
made and how well it does, in the Hugging Face hub's format (YAML metadata, then Markdown).

The licence is the user's to choose: the card leaves `license:` commented out, and a card written over an
older one keeps the `license:` line the user set there. A card file minigpt did not write is never replaced.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minigpt import __version__
from minigpt.common.files import atomic_write_bytes, read_bounded
from minigpt.convert.hf_map import ARCHITECTURES, family_for
from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig

__all__ = ["CARD_MARKER", "data_label", "kept_license", "model_card", "settings_line", "write_card"]

# in every card minigpt writes: a card file without it is the user's own and is never replaced
CARD_MARKER = "<!-- written by minigpt: regenerated at every save; the license line above is kept -->"

_LICENSE_HINT = (
    "# license: choose one before you share this model, e.g. mit, apache-2.0 or cc-by-4.0 "
    "(https://huggingface.co/docs/hub/repositories-licenses), and respect your training data's terms"
)
_LICENSE_LINE = re.compile(r"^license:[ \t]*(\S.*)$", re.MULTILINE)
_SETTINGS = (
    "batch_size",
    "grad_accum",
    "optimizer",
    "lr",
    "schedule",
    "warmup",
    "weight_decay",
    "seed",
    "lora_rank",
)


def data_label(data: dict[str, Any]) -> str:
    """What a run learned from, in a few words: its input files' names, or where converted weights came from."""
    if isinstance(data.get("source"), dict):
        return f"converted from {data['source'].get('path', '?')}"
    if isinstance(data.get("adapter"), dict):  # a LoRA run: its data, on its base
        base = Path(str(data["adapter"].get("base", "?"))).name
        return f"{data_label({'data': data.get('data')})} (LoRA on {base})"
    paths = (data.get("data") or {}).get("paths") or []
    names = [Path(str(p)).name for p in paths]
    return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "") if names else "?"


def settings_line(train: dict[str, Any], metrics: dict[str, Any] | None = None) -> str:
    """The training recipe in one line (key=value), with the warmup the run used where the budget capped
    the one asked for (`metrics`: config.json's)."""
    if not train:
        return ""
    used = (metrics or {}).get("warmup_steps")
    shown = dict(train)
    if isinstance(used, int) and used != train.get("warmup"):
        shown["warmup"] = f"{used} ({train.get('warmup')} asked, capped by the budget)"
    return " ".join(f"{k}={shown[k]}" for k in _SETTINGS if shown.get(k) is not None)


def write_card(path: Path, render: Callable[[str | None], str]) -> bool:
    """Write the card `render(license)` gives to path, `license` being the one set in the card there
    before; a card file there that minigpt did not write stays as it is (returns False)."""
    old = read_bounded(path).decode("utf-8", errors="replace") if path.is_file() else None
    if old is not None and CARD_MARKER not in old:
        return False
    atomic_write_bytes(path, render(kept_license(old)).encode("utf-8"))
    return True


def kept_license(old_card: str | None) -> str | None:
    """The `license:` value a user set in a card minigpt wrote before (None: none set)."""
    if not old_card or not old_card.startswith("---\n"):
        return None
    front = old_card[4:].split("\n---", 1)[0]
    found = _LICENSE_LINE.search(front)
    return found.group(1).strip() if found else None


def _architecture(config: GPTConfig) -> str:
    shape = (
        f"{config.n_layer} layers, {config.n_head} heads ({config.kv_heads} key/value), width {config.n_embd}, "
        f"MLP {config.d_ff}, context {config.block_size} tokens, vocabulary {config.vocab_size:,}"
    )
    parts = [f"{config.pos} positions", config.norm, config.mlp, "QK-norm" if config.qk_norm else None,
             "tied head" if config.tie_embeddings else "untied head", "biases" if config.bias else "no biases"]  # fmt: skip
    try:
        hf = f"; in transformers: {ARCHITECTURES[family_for(config)]}"
    except MinigptError:
        hf = "; no transformers class holds this combination"
    return f"{shape}; {', '.join(p for p in parts if p)}{hf}"


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) and math.isfinite(value) else "—"


def _training(data: dict[str, Any]) -> str:
    last = (data.get("metrics") or {}).get("last") or {}
    if not isinstance(last.get("step"), int):
        return "not trained by minigpt" if data.get("source") else "not trained yet"
    tokens = last.get("tokens")
    spent = last.get("elapsed")
    minutes = f", {spent / 60:.1f} minutes" if isinstance(spent, int | float) else ""
    return f"{last['step']:,} steps, {_number(tokens, ',')} tokens{minutes}"


def _validation(data: dict[str, Any]) -> str:
    metrics = data.get("metrics") or {}
    loss, bpb = metrics.get("best_val_loss"), metrics.get("best_val_bpb")
    if not isinstance(loss, int | float):
        return "—"
    step = metrics.get("best_step")
    at = f" at step {step:,}" if isinstance(step, int) else ""
    if isinstance(metrics.get("best"), str):  # a DPO or RL run: its own measure, in words
        return f"{metrics['best'][:200]}{at}"
    return f"{_number(loss, '.4f')} nats per token, {_number(bpb, '.3f')} bits per byte (best{at})"


def model_card(
    name: str,
    data: dict[str, Any],
    config: GPTConfig,
    tokenizer: str,
    params: int,
    *,
    made_by: str,
    usage: str,
    library: str = "minigpt",
    license: str | None = None,
) -> str:
    """A model card for the model `data` (a run's config.json) describes: `made_by` says how this folder came
    to be, `usage` (Markdown) how to run it; `license` is the one the user chose, if any."""
    how = settings_line(data.get("train") or {}, data.get("metrics"))
    version = data.get("minigpt_version", __version__)
    rows = [
        ("Architecture", _architecture(config)),
        ("Parameters", f"{params:,}"),
        ("Tokenizer", tokenizer),
        ("Data", data_label(data)),
        ("Training", _training(data)),
        ("Validation loss", _validation(data)),
        ("How it was made", f"{made_by} (minigpt {version}){'; ' + how if how else ''}"),
        ("License", license or "not set: the weights are yours to license; choose one before you share them"),
    ]
    table = "\n".join(f"| {k} | {v.replace('|', '/')} |" for k, v in rows)
    front = f"license: {license}" if license else _LICENSE_HINT
    return (
        f"---\n{front}\nlibrary_name: {library}\npipeline_tag: text-generation\ntags:\n- minigpt\n---\n\n"
        f"{CARD_MARKER}\n\n# {name}\n\nA small GPT-style language model made with minigpt.\n\n| | |\n|---|---|\n{table}\n\n"
        f"## Use\n\n{usage}\n"
    )
