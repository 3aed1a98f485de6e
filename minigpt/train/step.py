"""The two things a training loop repeats: one optimizer step, and an evaluation on fixed windows."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from minigpt.chat.data import ConversationData, ConversationSplit
from minigpt.common.device import autocast_context
from minigpt.data.dataset import BatchSampler, Dataset, bits_per_byte, eval_batches
from minigpt.model.config import GPTConfig
from minigpt.model.fused_attention import cpu_half_attention
from minigpt.train.budget import EvalCost
from minigpt.train.distributed import DistContext
from minigpt.train.optimizers import Optimizers

# one micro-batch's loss: (the model as steps call it, a batch from the sampler, the device)
MicroLoss = Callable[[torch.nn.Module, Any, torch.device], torch.Tensor]
EVAL_CHUNK = 256  # windows per evaluation forward pass, at most
EVAL_LOGITS = 1 << 25  # logits elements per evaluation forward pass, at most (128 MB in float32)


@dataclass(frozen=True)
class Runtime:
    """Where a run computes: its device, its autocast dtype, this process's place among the ranks, and on the
    CPU the dtype of half-precision attention over few keys (minigpt.model.fused_attention); the windows an
    evaluation's forward pass takes where given (--eval-chunk)."""

    device: torch.device
    dtype: torch.dtype
    dist: DistContext = field(default_factory=DistContext)
    attention_dtype: torch.dtype = torch.float32
    eval_chunk: int = 0  # windows per evaluation forward pass, within eval_chunk_limit (0: _chunk's rule)

    def autocast(self) -> contextlib.ExitStack[Any]:
        """The context a forward pass runs in: autocast to `dtype`, attention as `attention_dtype` says."""
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_context(self.device, self.dtype))
        stack.enter_context(cpu_half_attention(self.attention_dtype))
        return stack


def next_token_loss(model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
    """The mean cross-entropy of a batch (x, y) of windows or conversations: the language model's loss."""
    x, y = batch
    _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
    return loss


def train_step(
    model: torch.nn.Module,
    optimizer: Optimizers,
    sampler: BatchSampler,
    runtime: Runtime,
    *,
    lr: float,
    grad_accum: int = 1,
    grad_clip: float = 0.0,
    abandon: Callable[[], bool] | None = None,
    loss_of: MicroLoss = next_token_loss,
) -> float | None:
    """One optimizer step at learning rate `lr` over `grad_accum` micro-batches from `sampler`, each one's
    loss `loss_of(model, batch, device)`.

    Returns the loss, averaged over the micro-batches and the ranks (so every rank sees a NaN on any).
    A loss that is not finite is returned without stepping: the weights stay as they were. `abandon`, asked
    after each micro-batch, can give the step up (None is returned, gradients and batch position as before
    the step): a step of very many micro-batches must not outlast a time budget or a Ctrl-C.
    """
    optimizer.set_lr(lr)
    loss_sum = torch.zeros((), device=runtime.device)
    for micro in range(grad_accum):
        batch = sampler.next_batch()
        with runtime.dist.no_sync(model, last=micro == grad_accum - 1), runtime.autocast():
            loss = loss_of(model, batch, runtime.device) / grad_accum
        loss.backward()
        loss_sum += loss.detach()
        if abandon is not None and micro + 1 < grad_accum and abandon():
            optimizer.zero_grad(set_to_none=True)
            sampler.batches -= micro + 1
            return None
    loss_tensor = runtime.dist.all_reduce_mean(loss_sum)
    mean_loss = _clip_gradients(model, grad_clip, loss_tensor) if grad_clip > 0 else loss_tensor.item()
    if math.isfinite(mean_loss):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss


def _clip_gradients(model: torch.nn.Module, max_norm: float, loss: torch.Tensor) -> float:
    """clip_grad_norm_'s scaling by min(max_norm / (norm + 1e-6), 1), skipped when that factor is 1 (most
    steps once training settles), which leaves the gradients bitwise as the multiplication would; the loss
    is read in the same device sync as the factor. Returns the loss."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    factor = max_norm / (norm + 1e-6)
    value, scale = torch.stack([loss.float(), factor.float()]).tolist()
    if not scale >= 1.0:  # a NaN factor scales too, as clip_grad_norm_ would
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return value


def eval_chunk_limit(config: GPTConfig, batch_size: int) -> int:
    """The most windows an evaluation's forward pass takes: forward-only passes keep nothing for a backward
    pass, so they may take more windows at once than a step, up to EVAL_CHUNK and with the logits of one
    pass under EVAL_LOGITS elements."""
    return max(batch_size, min(EVAL_CHUNK, EVAL_LOGITS // (config.block_size * config.vocab_size)))


def _chunk(config: GPTConfig, batch_size: int, runtime: Runtime) -> int:
    """The windows each evaluation pass takes: as given, else the most on a GPU, and on the CPU the batch
    size. Larger passes outgrow the CPU's caches (256 windows took 1.45-1.75x as long per window on a
    32 MB L3), and the few percent a pass of two or four batches gained per window once warm was lost on
    a command's first evaluation, which makes the new shape's kernels (the steps made the batch's)."""
    most = eval_chunk_limit(config, batch_size)
    if runtime.eval_chunk:
        return min(runtime.eval_chunk, most)
    return batch_size if runtime.device.type == "cpu" else most


@torch.no_grad()
def split_loss(
    model: torch.nn.Module,
    config: GPTConfig,
    tokens: np.ndarray | ConversationSplit,
    batch_size: int,
    eval_iters: int,
    runtime: Runtime,
    tick: Callable[[int], None] | None = None,
) -> float:
    """Mean loss per predicted token over eval_iters x batch_size evenly spaced windows of `tokens` (or
    conversations: their assistant tokens): the same ones every time, shared out between ranks (one may get
    fewer, or none: windows are counted, not batches). `tick` is told each forward pass's windows."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=runtime.device, dtype=torch.float64)  # loss x targets, targets
    dist = runtime.dist
    chunk = _chunk(config, batch_size, runtime)
    if isinstance(tokens, ConversationSplit):
        batches = tokens.eval_batches(batch_size, eval_iters, dist.rank, dist.world_size, chunk=chunk)
    else:
        batches = eval_batches(
            tokens, config.block_size, batch_size, eval_iters, dist.rank, dist.world_size, chunk=chunk
        )
    for x, y in batches:
        with runtime.autocast():
            _, loss = model(x.to(runtime.device), y.to(runtime.device))
        targets = int((y >= 0).sum())
        sums[0] += loss.double() * targets
        sums[1] += targets
        if tick is not None:
            tick(len(x))
    model.train(was_training)
    total, counted = dist.all_reduce_sum(sums).tolist()
    return total / max(counted, 1.0)


def evaluate(
    model: torch.nn.Module,
    config: GPTConfig,
    dataset: Dataset | ConversationData,
    batch_size: int,
    eval_iters: int,
    runtime: Runtime,
    tick: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Validation loss, bits per byte and perplexity, and the loss on as many fixed windows of the training
    split (nanoGPT's convention: both measured the same way, so the gap between them means something);
    `tick` is told the windows of each forward pass as it is done."""
    val_loss = split_loss(model, config, dataset.val, batch_size, eval_iters, runtime, tick)
    train_loss = split_loss(model, config, dataset.train, batch_size, eval_iters, runtime, tick)
    return {
        "val_loss": val_loss,
        "train_loss": train_loss,
        "val_bpb": bits_per_byte(val_loss, len(dataset.val), dataset.val_bytes),
        "val_ppl": math.exp(min(val_loss, 700)),
    }


def eval_cost(
    model: torch.nn.Module,
    config: GPTConfig,
    dataset: Dataset | ConversationData,
    batch_size: int,
    runtime: Runtime,
    clock: Callable[[], float] = time.perf_counter,
) -> EvalCost:
    """What evaluate() costs a process, from a timed forward pass over a batch of windows, the second of two:
    the first pays one-off costs (the CPU's bf16 kernels, allocations) several times a pass's own, and
    timing it would leave a short run with no periodic evaluation to measure again part of its budget
    unused and its final evaluation shrunk to fit. Evaluations pass the batch size on the CPU and larger
    chunks on a GPU, so this errs long if at all; the second pass costs about half a training step. Also
    the windows each split holds (a conversation is one window)."""
    if isinstance(dataset, ConversationData):
        measured = min(batch_size, dataset.val.conversations)

        def one_pass() -> None:
            split_loss(model, config, dataset.val, batch_size, 1, runtime)

    else:
        sample = dataset.val[: batch_size * config.block_size + 1]
        measured = (len(sample) - 1) // config.block_size

        def one_pass() -> None:
            split_loss(model, config, sample, batch_size, len(sample), runtime)

    seconds = second_pass_seconds(one_pass, clock)
    return EvalCost(seconds / max(1, measured), batch_size, split_windows(config, dataset, runtime))


def second_pass_seconds(one_pass: Callable[[], object], clock: Callable[[], float]) -> float:
    """The time of the second of two calls of `one_pass` (see eval_cost)."""
    one_pass()
    start = clock()
    one_pass()
    return clock() - start


def split_windows(
    config: GPTConfig, dataset: Dataset | ConversationData, runtime: Runtime
) -> tuple[int, int]:
    """The windows of the validation and training splits, per process (rank 0's share: the largest)."""
    world = runtime.dist.world_size
    if isinstance(dataset, ConversationData):
        return tuple(-(-s.conversations // world) for s in (dataset.val, dataset.train))  # type: ignore[return-value]
    return tuple(-(-((len(t) - 1) // config.block_size) // world) for t in (dataset.val, dataset.train))  # type: ignore[return-value]
