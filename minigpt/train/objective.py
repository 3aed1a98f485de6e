"""What a run trains for: each micro-batch's loss, the evaluations and their cost, and the figures a step
logs. `NextToken` is the language model's (text, conversations); DPO on preference pairs and RL with a
reward on tasks are minigpt.feedback's, and the data chooses (minigpt.feedback.plan). Everything else a run
does (budget, schedule, checkpoints, resume, LoRA) is the same for all three.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from minigpt.chat.data import ConversationData, ConversationSplit
from minigpt.data.dataset import Dataset, bits_per_byte
from minigpt.model.config import GPTConfig
from minigpt.train.budget import EvalCost
from minigpt.train.step import (
    Runtime,
    eval_cost,
    evaluate,
    next_token_loss,
    second_pass_seconds,
    split_windows,
)


class Objective:
    """A run's objective, as the training loop and its evaluations call it."""

    def __init__(self) -> None:
        # tensors a checkpoint keeps beside the weights (the starting model, or its scores), restored in place
        self.reference: dict[str, torch.Tensor] = {}

    def loss(self, model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        """One micro-batch's loss, with its graph (train_step's `loss_of`)."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Figures the latest step logs beside its loss."""
        return {}

    def evaluate(
        self,
        model: torch.nn.Module,
        config: GPTConfig,
        dataset: Any,
        batch_size: int,
        eval_iters: int,
        runtime: Runtime,
        tick: Callable[[int], None] | None = None,
    ) -> dict[str, float]:
        """An evaluation's record: val_loss (lower is better: it picks the best checkpoint) and others;
        `tick` is told the rows once they are all scored."""
        record = self.scores(model, batch_size, eval_iters, runtime)
        if tick is not None:
            windows = self.split_windows(config, dataset, runtime)
            tick(sum(min(eval_iters * batch_size, n) for n in windows))
        return record

    def scores(
        self, model: torch.nn.Module, batch_size: int, eval_iters: int, runtime: Runtime
    ) -> dict[str, float]:
        """evaluate()'s record, from eval_iters x batch_size rows of each split the objective reads."""
        raise NotImplementedError

    def eval_cost(
        self,
        model: torch.nn.Module,
        config: GPTConfig,
        dataset: Any,
        batch_size: int,
        runtime: Runtime,
        clock: Callable[[], float] = time.perf_counter,
    ) -> EvalCost:
        """What evaluate() costs, from a timed evaluation of a batch a split (the second of two, as
        step.eval_cost times it)."""
        windows = self.split_windows(config, dataset, runtime)
        seconds = second_pass_seconds(
            lambda: self.evaluate(model, config, dataset, batch_size, 1, runtime), clock
        )
        return EvalCost(seconds / max(1, sum(min(batch_size, n) for n in windows)), batch_size, windows)

    def split_windows(self, config: GPTConfig, dataset: Any, runtime: Runtime) -> tuple[int, ...]:
        """The rows (windows, conversations, pairs, tasks) of each split an evaluation reads."""
        raise NotImplementedError

    def row_tokens(self, block_size: int) -> int:
        """Tokens one row of a training batch (a window, a conversation, a pair, a task) counts for."""
        raise NotImplementedError

    def best_bpb(self, loss: float) -> float | None:
        """Bits per byte of a validation loss, where it has any."""
        return None

    def describe_best(self, loss: float) -> str | None:
        """The best validation result in words (None: the loss and bits per byte say it)."""
        return None


class NextToken(Objective):
    """The language model's loss: every next token of text, or the assistant's tokens of conversations."""

    loss = staticmethod(next_token_loss)  # type: ignore[assignment]
    evaluate = staticmethod(evaluate)  # type: ignore[assignment]
    eval_cost = staticmethod(eval_cost)  # type: ignore[assignment]
    split_windows = staticmethod(split_windows)  # type: ignore[assignment]

    def __init__(self, dataset: Dataset | ConversationData) -> None:
        super().__init__()
        self.dataset = dataset

    def row_tokens(self, block_size: int) -> int:
        """A window of block_size, or a conversation of the training split's mean length (so counts stay
        exact on resume)."""
        train = self.dataset.train
        if isinstance(train, ConversationSplit):
            return max(1, round((train.tokens - train.conversations) / train.conversations))
        return block_size

    def best_bpb(self, loss: float) -> float | None:
        return bits_per_byte(loss, len(self.dataset.val), self.dataset.val_bytes)
