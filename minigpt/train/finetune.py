"""Fine-tuning a trained run: its tokenizer given the chat tokens it lacks, its shape grown to hold them, and
the model built from its weights, trained in full or as LoRA adapters on the frozen base (minigpt.model.lora).

New token rows start as the mean of the base's rows (embedding and head alike): a new token then reads as
an average token and is predicted with an average logit, so the base model's distribution over its own
tokens barely moves before training, unlike random rows that could dominate the softmax.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from minigpt.chat.template import with_chat_tokens
from minigpt.convert.config import MergeConfig
from minigpt.corpus.progress import QUIET, Progress
from minigpt.errors import UsageError
from minigpt.model.adapters import init_adapters
from minigpt.model.build import build_model, uninitialized
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.lora import ADDED, EMBEDDING, HEAD, LoRAConfig, file_sha256, resolve_targets
from minigpt.runs.folder import AdapterLink, RunDir
from minigpt.tokenizer.base import Tokenizer
from minigpt.train.config import TrainConfig


def plan_fine_tune(
    source: Path, cfg: TrainConfig, chat: bool
) -> tuple[Tokenizer, GPTConfig, AdapterLink | None]:
    """The tokenizer (with the chat tokens for conversation data), the model shape (rows for every token;
    cfg's overrides, its dropout, applied) and, with cfg.lora_rank, the adapter's link to its base, for a run
    starting from `source`."""
    run = RunDir(source)
    base = run.model_config()
    tokenizer = run.tokenizer()
    if chat:
        tokenizer = with_chat_tokens(tokenizer, base.vocab_size)
    shape = replace(base, **cfg.overrides, vocab_size=max(base.vocab_size, tokenizer.vocab_size))
    if cfg.lora_rank is None:
        return tokenizer, shape, None
    if run.adapter_link() is not None:
        raise UsageError(
            f"{source} is a LoRA run: merge it into a plain run first (minigpt convert merge {source} --out DIR), "
            f"then train adapters on that"
        )
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
    targets, whole = resolve_targets(cfg.lora_targets, shape)
    lora = LoRAConfig(cfg.lora_rank, alpha, targets, shape.vocab_size - base.vocab_size, whole)
    if lora.new_rows and base.value_embeds:
        raise UsageError(
            f"{source} has value embeddings (--value-embeds), a row per token that LoRA cannot add for the "
            f"{lora.new_rows} chat tokens: fine-tune every weight (drop --lora-rank) or train on plain text"
        )
    return tokenizer, shape, AdapterLink(Path(source).resolve(), file_sha256(run.weights_path), lora)


def adapter_settings(link: AdapterLink) -> dict[str, object]:
    """config.json's adapter section of a LoRA run."""
    return {"base": str(link.base), "base_sha256": link.base_sha256, "lora": link.lora.to_json()}


def grown(tensors: dict[str, torch.Tensor], rows: int, tied: bool) -> dict[str, torch.Tensor]:
    """The embedding (an untied head, value embeddings) grown to `rows` rows, each new row the mean of the
    old ones."""
    out = dict(tensors)
    names = [f"{layer}.weight" for layer in ((EMBEDDING,) if tied else (EMBEDDING, HEAD))]
    names += [name for name in tensors if name.endswith(".attn.v_embed.weight")]
    for name in names:
        w = out[name]
        out[name] = torch.cat([w, _mean_rows(w, rows - w.size(0))])
    return out


def _mean_rows(w: torch.Tensor, n: int) -> torch.Tensor:
    return w.float().mean(0, keepdim=True).expand(n, -1).to(w.dtype)


def full_model(shape: GPTConfig, source: Path, device: torch.device) -> GPT:
    """A model of `shape` holding `source`'s weights (every one trainable), new token rows added."""
    run = RunDir(source)
    base = replace(run.model_config(), dropout=shape.dropout)
    tensors = run.load_weights(base)
    if shape.vocab_size > base.vocab_size:
        tensors = grown(tensors, shape.vocab_size, shape.tie_embeddings)
    return build_model(shape, tensors, run.weights_path, str(device))


def lora_model(shape: GPTConfig, link: AdapterLink, out: Path, device: torch.device, fresh: bool) -> GPT:
    """A model of `shape` with the base's weights frozen and LoRA adapters to train: B zero and the new
    rows the base's mean for a `fresh` run (a resumed one restores them from its state)."""
    model = uninitialized(shape, link.lora)
    base = RunDir(out).base_weights(shape, link)
    model.load_state_dict(base, strict=False)  # the adapter's tensors are all the state lacks
    if fresh:
        init_adapters(model, shape.n_layer)
        layers = (EMBEDDING,) if shape.tie_embeddings else (EMBEDDING, HEAD)
        with torch.no_grad():
            for layer in layers if link.lora.new_rows else ():
                rows = _mean_rows(base[f"{layer}.weight"], link.lora.new_rows)
                model.get_parameter(f"{layer}.{ADDED}").copy_(rows)
    return model.to(device)


def describe(link: AdapterLink, shape: GPTConfig, total: int) -> str:
    """One line on what a LoRA run trains."""
    from minigpt.model.lora import trainable_count, whole_words

    trained = trainable_count(shape, link.lora)
    rows = f" and {link.lora.new_rows} new token rows" if link.lora.new_rows else ""
    whole = f"; {', '.join(whole_words(link.lora.whole))} trained whole" if link.lora.whole else ""
    return (
        f"LoRA rank {link.lora.rank} (alpha {link.lora.alpha:g}) on {', '.join(link.lora.targets) or 'no layer'}"
        f"{rows}{whole}: "
        f"{trained:,} of {total:,} parameters trained ({trained / total:.1%}), base {link.base} frozen"
    )


def merge_run(run: Path, cfg: MergeConfig, overwrite: bool = False, progress: Progress = QUIET) -> Path:
    """Write a LoRA run as a plain run at `cfg.out`: its base's weights with the adapter merged in
    (W + alpha/rank B A, the new rows appended), its tokenizer, and its training record; `cfg.base` where
    the base run is now. `progress` shows the loading and the writing."""
    adapter = RunDir(run, base=cfg.base)
    data = adapter.read_config()
    link = adapter.adapter_link(data)
    if link is None:
        raise UsageError(f"{run} is not a LoRA run (it has no adapter): it is a plain run already")
    merged = RunDir(cfg.out)
    if merged.path.resolve() in (adapter.path.resolve(), link.base.resolve()):
        raise UsageError("--out would replace the LoRA run or its base: choose another folder")
    merged.guard_new(overwrite)
    with progress.phase(f"loading {run} and its base {link.base}"):
        model, tokenizer, _ = adapter.load_model()
    source = {"kind": "lora", "path": str(adapter.path.resolve()), "base": str(link.base)}
    extra = {"source": source, "metrics": data.get("metrics", {})}
    with merged.lock(), progress.phase(f"writing {merged.path}"):
        merged.clear()
        merged.save(model, tokenizer, extra)
    return merged.path
