"""Reinforcement learning with verifiable rewards, GRPO-style (Shao et al. 2024): tasks, groups of sampled
answers, group-relative advantages, the loss, and its evaluation.

Each step takes batch_size task prompts and samples G answers to each (--group-size) from the current
model through the decode loop (minigpt.feedback.answers), scores every answer with the reward
(minigpt.feedback.rewards), and gives each the advantage of its reward within its group,

    A = (r - mean of the group's rewards) / (std of the group's rewards + 1e-4)

(the sample standard deviation, as TRL's GRPOTrainer takes it; a group whose answers all score alike
teaches nothing but the KL term). The loss over every answer token t of every answer, averaged over all the
step's answer tokens, is

    -A · π(t) / sg(π(t)) + β_KL · (π_ref(t) / π(t) - log(π_ref(t) / π(t)) - 1)

The first term is 1·A in value, and its gradient A ∇log π(t): one update per sampled batch, so the
policy that sampled the answers is the one being updated and the PPO ratio is exactly 1 (no clipping needed,
none applied). The second is the k3 estimator of KL(π || π_ref) (Schulman 2020), never negative, weighted
by --kl-coef; π_ref is the starting model, kept beside the policy (`reference_tree`: for LoRA the base
weights are shared and only the trained tensors are copied). The sampling seed of a batch comes from the
run's seed and the batch's number, which the checkpoint keeps, so a resumed run samples what the
uninterrupted one sampled.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.chat.data import ConversationData, ConversationSampler, Skipped, read_records, read_splits
from minigpt.chat.template import ChatTemplate
from minigpt.data.dataset import DataConfig, eval_rows
from minigpt.feedback.answers import Answer, answer
from minigpt.feedback.logprobs import token_logprobs
from minigpt.feedback.records import Task, parse_task
from minigpt.feedback.rewards import Reward
from minigpt.generate.decode import Sampling
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.model.adapters import adapted_weights
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.weights import ModelWeights, weights_by_name
from minigpt.tokenizer.base import Tokenizer
from minigpt.train.objective import Objective
from minigpt.train.step import Runtime

ADVANTAGE_EPS = 1e-4


class TaskSplit:
    """Tasks, rendered; `conversations` is how many (the name the trainer counts rows by)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = list(tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    @property
    def conversations(self) -> int:
        return len(self.tasks)

    @property
    def tokens(self) -> int:
        return sum(len(t.prompt) for t in self.tasks)


class TaskSampler(ConversationSampler):
    """batch_size random tasks a batch, drawn as ConversationSampler draws, with the batch's sampling seed."""

    tokens: TaskSplit  # type: ignore[assignment]

    def next_batch(self) -> tuple[list[int], int]:  # type: ignore[override]
        seed = self._batch_seed(self.batches)
        self._gen.manual_seed(seed)
        self.batches += 1
        rows = torch.randint(0, self.tokens.conversations, (self.batch_size,), generator=self._gen)
        return rows.tolist(), seed & ((1 << 63) - 1)


@dataclass
class TaskData(ConversationData):
    """Training and validation tasks, as the trainer takes a Dataset."""

    train: TaskSplit  # type: ignore[assignment]
    val: TaskSplit  # type: ignore[assignment]
    reward: Reward | None = None  # how answers are scored (read first: it says whether tasks need answers)
    sampler_class = TaskSampler

    @property
    def summary(self) -> str:
        return f"{len(self.train):,} train / {len(self.val):,} val tasks"


# ---------------------------------------------------------------------------------------------- the loss


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """(r - mean) / (std + eps) within each row of rewards (prompts x answers), std the sample one."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(π || π_ref) at each sampled token: r - log r - 1 with r = π_ref / π."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over the answer tokens (mask) of rows (B, T) with one advantage a row, summed over those
    tokens and divided by `tokens` (default: their number; more when rows that add nothing were left out),
    and the mean KL estimate (0 without a reference)."""
    ratio = torch.exp(logp - logp.detach())
    count = mask.sum().clamp(min=1)
    per_token = -ratio * advantages[:, None]
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        estimate = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * estimate
        kl = (estimate.detach() * mask).sum() / count
    return (per_token * mask).sum() / (tokens or count), kl


def answer_batch(
    prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[Answer]], widest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of every answer after its prompt, groups in order: y is the answer's tokens where the model
    predicts them, -1 elsewhere (the prompt, the padding)."""
    rows = [([*p, *a.ids], len(p)) for p, group in zip(prompts, groups, strict=True) for a in group]
    # as wide as the longest: answers are short, so few widths occur (and padding to a multiple would
    # double the work of a batch of short ones)
    width = min(max(len(full) for full, _ in rows) - 1, widest)
    x = np.zeros((len(rows), width), dtype=np.int64)
    y = np.full((len(rows), width), -1, dtype=np.int64)
    for i, (full, start) in enumerate(rows):
        x[i, : len(full) - 1] = full[:-1]
        y[i, start - 1 : len(full) - 1] = full[start:]
    return torch.from_numpy(x), torch.from_numpy(y)


# ---------------------------------------------------------------------------------------------- the reference


def frozen_copies(model: GPT) -> dict[str, torch.Tensor]:
    """A copy of every tensor the model trains: with the frozen ones, the starting model."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def reference_tree(model: GPT, copies: dict[str, torch.Tensor]) -> ModelWeights[torch.Tensor]:
    """The starting model's weight tree: `copies` in place of the trained tensors, the frozen ones shared."""
    tensors = {name: copies.get(name, p.detach()) for name, p in model.named_parameters()}
    if model.lora is None:
        return weights_by_name(model.config, tensors)
    return adapted_weights(model.config, tensors, model.lora)


# ---------------------------------------------------------------------------------------------- the objective


@dataclass(frozen=True)
class Settings:
    """How RL samples and weighs: answers per prompt, their length and temperature, the KL's weight."""

    group_size: int
    answer_tokens: int
    temperature: float
    kl_coef: float


class GroupRelative(Objective):
    """GRPO as a run's objective: each micro-batch samples, scores and weighs answers; evaluations score
    greedy answers to fixed validation tasks."""

    def __init__(self, settings: Settings, data: TaskData, model: GPT) -> None:
        assert data.reward is not None, "prepare_tasks gives tasks their reward"
        super().__init__()
        self.settings, self.data, self.model, self.reward = settings, data, model, data.reward
        self.template = ChatTemplate(data.tokenizer)
        # the starting model, for the KL term: what a checkpoint keeps beside the weights
        self.reference = frozen_copies(model) if settings.kl_coef > 0 else {}
        self._recent: collections.deque[tuple[torch.Tensor, float]] = collections.deque(maxlen=1)

    def answers(self, tasks: Sequence[Task], samples: int, sampling: Sampling) -> list[list[Answer]]:
        """`samples` answers to each task from the model as it is now (eval mode: no dropout)."""
        was_training = self.model.training
        self.model.eval()
        try:
            engine = TorchEngine(self.model, threads=torch.get_num_threads())
            return answer(
                engine, self.data.tokenizer, [t.prompt for t in tasks], samples=samples,
                max_tokens=self.settings.answer_tokens, stop_ids=self.template.stop_ids, sampling=sampling,
            )  # fmt: skip
        finally:
            self.model.train(was_training)

    def rewards(self, tasks: Sequence[Task], groups: Sequence[Sequence[Answer]]) -> torch.Tensor:
        return torch.tensor(
            [[self.reward(a.text, t) for a in g] for t, g in zip(tasks, groups, strict=True)],
            dtype=torch.float64,
        )

    def loss(self, model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        rows, seed = batch
        s = self.settings
        tasks = [self.data.train.tasks[r] for r in rows]
        groups = self.answers(tasks, s.group_size, Sampling(s.temperature, seed=seed))
        rewards = self.rewards(tasks, groups)
        advantages = group_advantages(rewards).flatten().float()
        x, y = answer_batch([t.prompt for t in tasks], groups, self.model.config.block_size)
        tokens = int((y >= 0).sum())
        # without a KL term an answer whose advantage is 0 adds nothing: it is left out of the passes
        keep = (advantages != 0) | (s.kl_coef > 0)
        keep[0] = True  # one row at least, so the step has a graph
        x, y, advantages = x[keep].to(device), y[keep].to(device), advantages[keep].to(device)
        logp = token_logprobs(model, x, y)
        reference = self._reference_logprobs(x, y) if self.reference else None
        loss, kl = policy_loss(logp, reference, advantages, y >= 0, s.kl_coef, tokens)
        self._recent.append((rewards, kl.item()))
        return loss

    @torch.no_grad()
    def _reference_logprobs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            # the tree is read anew: new token rows join the embedding as a copy, and a resume restores them
            return token_logprobs(self.model, x, y, weights=reference_tree(self.model, self.reference))
        finally:
            self.model.train(was_training)

    def stats(self) -> dict[str, float]:
        """The last micro-batch's mean reward, its spread (standard deviation) and the mean KL estimate (with
        a KL term)."""
        if not self._recent:
            return {}
        rewards, kl = self._recent[-1]
        spread = {"reward": rewards.mean().item(), "reward_std": rewards.std(unbiased=False).item()}
        return {**spread, "kl": kl} if self.reference else spread

    def scores(
        self, model: torch.nn.Module, batch_size: int, eval_iters: int, runtime: Runtime
    ) -> dict[str, float]:
        """The mean reward of greedy answers to eval_iters x batch_size evenly spaced validation tasks; its
        negative is the run's validation loss (the best checkpoint is the best rewarded)."""
        tasks = [self.data.val.tasks[r] for r in eval_rows(len(self.data.val), batch_size, eval_iters)]
        with runtime.autocast():
            groups = self.answers(tasks, 1, Sampling(temperature=0.0))
        reward = self.rewards(tasks, groups).mean().item()
        return {"val_loss": -reward, "val_reward": reward}

    def split_windows(self, config: GPTConfig, dataset: Any, runtime: Runtime) -> tuple[int, ...]:
        return (len(self.data.val),)

    def row_tokens(self, block_size: int) -> int:
        """Tokens a task reads at most: its group's answers, each after the prompt (at the mean length)."""
        train = self.data.train
        return self.settings.group_size * (round(train.tokens / len(train)) + self.settings.answer_tokens)

    def describe_best(self, loss: float) -> str:
        return f"best val reward {-loss:.4f}"


def prepare_tasks(
    config: DataConfig,
    files: Sequence[Path],
    block_size: int,
    tokenizer: Tokenizer,
    answer_tokens: int,
    reward: Reward,
    note: Callable[[str], None] = lambda message: None,
) -> TaskData:
    """Read, check and render the task files (and config.val_file) with the chat template of `tokenizer`
    (a fine-tuned run's, given the chat tokens), each prompt leaving `answer_tokens` of the context."""
    template = ChatTemplate(tokenizer)

    def parse(line: bytes) -> Task:
        return parse_task(line, template, block_size, answer_tokens, reward.needs_answer)

    def read(path: Path, skipped: Skipped | None) -> Iterator[Task]:
        return read_records(path, parse, skipped)

    train, val, inputs, skipped = read_splits(config, files, read, "task", note)
    data = TaskData(tokenizer, TaskSplit(train), TaskSplit(val), 0, 0, inputs, skipped, reward)
    note(f"tasks: {data.summary}")
    return data
