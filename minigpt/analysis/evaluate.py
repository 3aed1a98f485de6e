"""Loss, perplexity and bits-per-byte of a trained model on any text, or on conversations' answers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from minigpt.analysis.eval_config import EvalConfig
from minigpt.chat.data import ConversationSplit, conversation_files, read_conversations
from minigpt.chat.template import ChatTemplate
from minigpt.common.device import autocast_context
from minigpt.corpus.progress import QUIET, Progress
from minigpt.data.dataset import bits_per_byte, eval_batches, eval_rows, read_text
from minigpt.errors import MinigptError
from minigpt.model.gpt import GPT
from minigpt.model.memory import allocating
from minigpt.model.weights import ModelWeights
from minigpt.tokenizer.base import Tokenizer


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy, nats per token
    perplexity: float
    bits_per_byte: float
    tokens: int  # tokens predicted
    bytes: int  # UTF-8 bytes those tokens spell
    windows: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def evaluate_ids(
    model: GPT,
    ids: np.ndarray,
    byte_lengths: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 16,
    max_windows: int | None = None,
    weights: ModelWeights[torch.Tensor] | None = None,
    progress: Progress = QUIET,
) -> EvalResult:
    """Score back-to-back windows of block_size tokens (each token predicted once, from its window),
    through `weights` (say a quantized tree, minigpt.model.quantize) in place of the model's own; `progress`
    shows the windows scored (default: nothing)."""
    T = model.config.block_size
    if len(ids) < 2:
        raise MinigptError(f"the text is only {len(ids)} token(s): need at least 2 to score a prediction")
    block, most = min(T, len(ids) - 1), _max_batches(max_windows, batch_size)
    windows = len(eval_rows((len(ids) - 1) // block, batch_size, most))
    batches = eval_batches(ids, block, batch_size, most)
    return _score(model, batches, windows, byte_lengths, device, dtype, weights, progress)


def _max_batches(max_windows: int | None, batch_size: int) -> int | None:
    return None if max_windows is None else max(1, math.ceil(max_windows / batch_size))


@torch.no_grad()
def _score(
    model: GPT,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    planned: int,
    byte_lengths: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    weights: ModelWeights[torch.Tensor] | None,
    progress: Progress,
) -> EvalResult:
    """Sum the loss of every (x, y) batch over its predicted tokens (targets of -1 are not predicted), the
    `planned` windows counted on `progress` as they are scored."""
    total_nats, tokens, nbytes, windows = 0.0, 0, 0, 0
    model.eval()
    with progress.phase("scoring", planned, unit="windows") as meter:
        for x, y in batches:
            with autocast_context(device, dtype):
                logits, _ = model(x.to(device), all_logits=True, weights=weights)
            nll = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1), reduction="sum",
                ignore_index=-1,
            )  # fmt: skip
            predicted = y[y >= 0]
            total_nats += nll.item()
            tokens += predicted.numel()
            nbytes += int(byte_lengths[predicted.numpy()].sum())
            windows += x.size(0)
            meter(x.size(0))
    loss = total_nats / tokens
    return EvalResult(
        loss=loss,
        perplexity=math.exp(min(loss, 700.0)),
        bits_per_byte=bits_per_byte(loss, tokens, max(nbytes, 1)),
        tokens=tokens,
        bytes=nbytes,
        windows=windows,
    )


def evaluate_files(
    model: GPT,
    tokenizer: Tokenizer,
    paths: list[Path],
    device: torch.device,
    dtype: torch.dtype,
    cfg: EvalConfig = EvalConfig(),
    errors: str = "strict",
    weights: ModelWeights[torch.Tensor] | None = None,
    progress: Progress = QUIET,
) -> EvalResult:
    """Score text files, or conversation JSONL files on the assistant's tokens only (as fine-tuning does:
    each conversation is a window), `cfg.batch_size` windows at a time (`cfg.dtype` is `dtype`'s name);
    `progress` shows the reading and the scoring (default: nothing)."""
    batch_size, most = cfg.batch_size, _max_batches(cfg.max_windows, cfg.batch_size)
    chats = conversation_files(paths)
    if chats is not None:
        template, block = ChatTemplate(tokenizer), model.config.block_size
        with progress.phase(f"reading {_names(paths)}"):
            split = ConversationSplit.of(
                [c for f in chats for c in read_conversations(f, template, block, None)]
            )
        batches = split.eval_batches(batch_size, most)
        windows = len(eval_rows(split.conversations, batch_size, most))
        return _score(
            model, batches, windows, tokenizer.text_byte_lengths(), device, dtype, weights, progress
        )
    with progress.phase(f"reading and tokenizing {_names(paths)}"):
        text = read_text(paths, cfg.encoding, errors)
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    with allocating(f"forward passes over {batch_size:,} windows of {model.config.block_size:,} tokens"):
        return evaluate_ids(
            model, ids, tokenizer.text_byte_lengths(), device, dtype, batch_size, cfg.max_windows, weights,
            progress,
        )  # fmt: skip


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths[:3]) + (f" (+{len(paths) - 3})" if len(paths) > 3 else "")


def evaluate_run(
    run: Path,
    paths: list[Path],
    cfg: EvalConfig = EvalConfig(),
    device_name: str = "auto",
    quantize: str = "none",
    progress: Progress = QUIET,
) -> EvalResult:
    """Score a run directory's best weights on text files as `cfg` says, on `device_name`, with its linear
    layers in `quantize` form as `minigpt generate --quantize` runs them; `progress` shows each phase (the
    load, the reading, the scoring; default: nothing)."""
    from minigpt.common.device import resolve_device, resolve_dtype
    from minigpt.model.quantize import check_quantize, quantize_weights
    from minigpt.runs.folder import RunDir

    device = resolve_device(device_name)
    check_quantize(quantize, device)
    with progress.phase(f"loading {run}"):
        model, tokenizer, _ = RunDir(run).load_model(str(device))
        weights = quantize_weights(model.weights(), quantize)
    dtype = resolve_dtype(cfg.dtype, device)
    return evaluate_files(model, tokenizer, paths, device, dtype, cfg, weights=weights, progress=progress)
