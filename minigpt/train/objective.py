"""What a run trains for, chosen by its data: the next token (text, conversations), preferences (DPO on
preference pairs) or a reward (GRPO on tasks). The training loop asks its objective for each micro-batch's
loss, for evaluations and their cost, and for the figures a step logs; everything else (budget, schedule,
checkpoints, resume, LoRA) is the same for all three.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from minigpt.chat.data import ConversationData, ConversationSplit, prepare_conversations
from minigpt.common.settings import options_of
from minigpt.data.dataset import DataConfig, Dataset, bits_per_byte
from minigpt.errors import UsageError
from minigpt.feedback.answers import MAX_ROWS
from minigpt.feedback.dpo import DirectPreference, PreferenceData, prepare_preferences
from minigpt.feedback.grpo import GroupRelative, Settings, TaskData, prepare_tasks
from minigpt.feedback.records import CONVERSATIONS, PREFERENCES, TASKS, files_kind
from minigpt.feedback.rewards import EXACT, make_reward
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.lora import LoRAConfig, trainable_count
from minigpt.model.memory import FLOAT32, kv_cache_bytes
from minigpt.model.params import count_params
from minigpt.tokenizer.base import Tokenizer
from minigpt.train.budget import EvalCost
from minigpt.train.config import TrainConfig
from minigpt.train.step import Runtime, eval_cost, evaluate, next_token_loss, split_windows

# the settings only one kind of data takes
SETTINGS_OF = {
    PREFERENCES: ("dpo_beta",),
    TASKS: ("reward", "group_size", "answer_tokens", "temperature", "kl_coef", "reward_timeout"),
}


class Objective(Protocol):
    """A run's objective, as the training loop and its evaluations call it."""

    # tensors a checkpoint keeps beside the weights (the reference model, or its scores), restored in place
    reference: dict[str, torch.Tensor]

    def loss(self, model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        """One micro-batch's loss, with its graph (train_step's `loss_of`)."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures the latest step logs beside its loss."""
        ...

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
        """An evaluation's record: val_loss (lower is better: it picks the best checkpoint) and others."""
        ...

    def eval_cost(
        self,
        model: torch.nn.Module,
        config: GPTConfig,
        dataset: Any,
        batch_size: int,
        runtime: Runtime,
        clock: Callable[[], float],
    ) -> EvalCost: ...

    def split_windows(self, config: GPTConfig, dataset: Any, runtime: Runtime) -> tuple[int, ...]: ...

    def row_tokens(self, block_size: int) -> int:
        """Tokens one row of a batch (a window, a conversation, a pair, a task) counts for."""
        ...

    def best_bpb(self, loss: float) -> float | None:
        """Bits per byte of a validation loss, where it has any."""
        ...

    def describe_best(self, loss: float) -> str | None:
        """The best validation result in words (None: the loss and bits per byte say it)."""
        ...


class NextToken:
    """The language model's loss: every next token of text, or the assistant's tokens of conversations."""

    loss = staticmethod(next_token_loss)
    evaluate = staticmethod(evaluate)
    eval_cost = staticmethod(eval_cost)
    split_windows = staticmethod(split_windows)

    def __init__(self, dataset: Dataset | ConversationData) -> None:
        self.dataset = dataset
        self.reference: dict[str, torch.Tensor] = {}

    def stats(self) -> dict[str, float]:
        return {}

    def row_tokens(self, block_size: int) -> int:
        """A window of block_size, or a conversation of the training split's mean length (so counts stay
        exact on resume)."""
        train = self.dataset.train
        if isinstance(train, ConversationSplit):
            return max(1, round((train.tokens - train.conversations) / train.conversations))
        return block_size

    def best_bpb(self, loss: float) -> float | None:
        return bits_per_byte(loss, len(self.dataset.val), self.dataset.val_bytes)

    def describe_best(self, loss: float) -> str | None:
        return None


# ---------------------------------------------------------------------------------------------- choosing one


def data_kind(cfg: TrainConfig, chat: list[Path] | None, init_from: Path | None) -> str | None:
    """What the JSONL files hold (None: text), checked against the settings given for another kind and
    against a run to start from, which preferences and tasks need."""
    kind = files_kind(chat, cfg.reward is not None) if chat is not None else None
    defaults, flags = TrainConfig(), {o.name: o.flag for o in options_of(TrainConfig)}
    for owner, names in SETTINGS_OF.items():
        given = [flags[n] for n in names if getattr(cfg, n) != getattr(defaults, n)]
        if given and kind != owner:
            raise UsageError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for {owner}, not {kind or 'text'}"
            )
    if kind in (PREFERENCES, TASKS) and init_from is None:
        raise UsageError(f"learning from {kind} starts from a trained run: name it with --init-from RUN")
    return kind


def prepare_jsonl(
    data: DataConfig,
    files: list[Path],
    cfg: TrainConfig,
    block_size: int,
    tokenizer: Tokenizer | None,
    note: Callable[[str], None],
) -> ConversationData:
    """Conversations, preference pairs or tasks, as the files hold."""
    kind = files_kind(files, cfg.reward is not None)
    if kind == CONVERSATIONS or tokenizer is None:
        return prepare_conversations(data, files, block_size, tokenizer, note)
    if kind == PREFERENCES:
        return prepare_preferences(data, files, block_size, tokenizer, note)
    reward = make_reward(cfg.reward or EXACT, cfg.reward_timeout)
    return prepare_tasks(data, files, block_size, tokenizer, cfg.answer_tokens, reward, note)


def make_objective(
    cfg: TrainConfig, dataset: Dataset | ConversationData, model: GPT, runtime: Runtime, fresh: bool
) -> Objective:
    """The objective the data calls for; a `fresh` run's reference is the model as it starts (DPO scores
    every pair with it now; a resumed run restores it from its checkpoint)."""
    assert cfg.batch_size is not None, "a resolved config (with_recipe)"
    if isinstance(dataset, PreferenceData):
        dpo = DirectPreference(cfg.dpo_beta, dataset)
        if fresh:
            dpo.score_reference(model, cfg.batch_size, runtime)
        return dpo
    if isinstance(dataset, TaskData):
        settings = Settings(cfg.group_size, cfg.answer_tokens, cfg.temperature, cfg.kl_coef)
        return GroupRelative(settings, dataset, model)
    return NextToken(dataset)


def planned_memory(
    cfg: TrainConfig, shape: GPTConfig, dataset: Dataset | ConversationData, lora: LoRAConfig | None
) -> tuple[int, int]:
    """The rows a training micro-batch holds, and the bytes the objective needs beside the model's state
    and a micro-batch's activations: RL's copy of the starting model's trained tensors (for a KL term)
    and the KV cache its answers are sampled with (DPO's reference scores are a few numbers a pair)."""
    assert cfg.batch_size is not None, "a resolved config (with_recipe)"
    if isinstance(dataset, PreferenceData):
        return 2 * cfg.batch_size, 2 * 8 * (dataset.train.pairs + dataset.val.pairs)
    if isinstance(dataset, TaskData):
        rows = cfg.batch_size * cfg.group_size
        trained = trainable_count(shape, lora) if lora is not None else count_params(shape).exact_total
        reference = trained * FLOAT32 if cfg.kl_coef > 0 else 0
        return rows, reference + kv_cache_bytes(shape, min(rows, MAX_ROWS))
    return cfg.batch_size, 0
