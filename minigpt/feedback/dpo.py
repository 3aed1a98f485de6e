"""Direct preference optimisation (Rafailov et al. 2023): pairs of answers, the loss, and its evaluation.

For a prompt x with a chosen answer c and a rejected one r, the policy π (the model being trained) and the
reference π_ref (the starting model, frozen), the loss is

    -log σ(β [(log π(c|x) - log π_ref(c|x)) - (log π(r|x) - log π_ref(r|x))])

with each log-probability summed over the answer's tokens only (its assistant messages' content and the
<|end|> closing each, as fine-tuning counts them). β (--dpo-beta) sets how far the policy may move from
the reference for a given preference. β (log π - log π_ref) is an answer's implicit reward: a pair is
ranked right when the chosen answer's is the higher (a tie counts half, so the starting model, whose
rewards are all 0, scores 50%), and the margin is the chosen answer's minus the rejected one's.

The reference is the starting model itself: before the first step it scores every pair's answers once
(`reference_logprobs`), and the run keeps those numbers (two per pair, in its state for a resume) instead
of a second model; its memory is the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from minigpt.chat.data import (
    ConversationData,
    ConversationSampler,
    ConversationSplit,
    Skipped,
    predicted_bytes,
    read_records,
    read_splits,
)
from minigpt.chat.template import ChatTemplate
from minigpt.data.dataset import DataConfig, eval_rows
from minigpt.feedback.logprobs import answer_logprobs
from minigpt.feedback.records import Pair, parse_pair
from minigpt.model.config import GPTConfig
from minigpt.tokenizer.base import Tokenizer
from minigpt.train.objective import Objective
from minigpt.train.step import Runtime


class PreferenceSplit(ConversationSplit):
    """Preference pairs, flat: pair i's chosen answer is conversation 2i, its rejected one 2i + 1; and the
    reference model's log-probability of each one's answer (`reference`, filled before training)."""

    def __init__(self, ids: np.ndarray, targets: np.ndarray, starts: np.ndarray) -> None:
        super().__init__(ids, targets, starts)
        self.reference = torch.zeros(self.conversations, dtype=torch.float64)

    @classmethod
    def of_pairs(cls, pairs: Sequence[Pair]) -> PreferenceSplit:
        return cls.of([side for p in pairs for side in (p.chosen, p.rejected)])  # type: ignore[return-value]

    @property
    def pairs(self) -> int:
        return self.conversations // 2

    def pair_batch(self, pairs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, reference) of these pairs: chosen and rejected rows alternating, as `batch` pads them."""
        rows = [r for p in pairs for r in (2 * p, 2 * p + 1)]
        x, y = self.batch(rows)
        return x, y, self.reference[rows]


class PairSampler(ConversationSampler):
    """batch_size random pairs a batch (2 x batch_size rows), drawn as ConversationSampler draws."""

    tokens: PreferenceSplit  # type: ignore[assignment]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        self._gen.manual_seed(self._batch_seed(self.batches))
        self.batches += 1
        pairs = torch.randint(0, self.tokens.pairs, (self.batch_size,), generator=self._gen)
        return self.tokens.pair_batch(pairs.tolist())


@dataclass
class PreferenceData(ConversationData):
    """Training and validation preference pairs, as the trainer takes a Dataset."""

    train: PreferenceSplit
    val: PreferenceSplit
    sampler_class = PairSampler

    @property
    def summary(self) -> str:
        return (
            f"{self.train.pairs:,} train / {self.val.pairs:,} val preference pairs "
            f"({len(self.train):,} / {len(self.val):,} answer tokens)"
        )


# ---------------------------------------------------------------------------------------------- the loss


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, the DPO loss and the reward margin, from log-probabilities of (chosen, rejected) rows
    alternating, as pair_batch gives them."""
    ratio = (policy - reference).view(-1, 2)
    margin = beta * (ratio[:, 0] - ratio[:, 1])
    return F.softplus(-margin), margin.detach()  # softplus(-z) is -log σ(z), stable for any z


@dataclass(frozen=True)
class PairScore:
    loss: float  # the mean DPO loss
    accuracy: float  # pairs ranked right, a tie counting half
    margin: float  # the mean reward margin


def ranked_right(margin: torch.Tensor) -> torch.Tensor:
    return (margin > 0).double() + 0.5 * (margin == 0).double()


class DirectPreference(Objective):
    """DPO as a run's objective: each micro-batch's loss, evaluations on fixed pairs of both splits."""

    def __init__(self, beta: float, data: PreferenceData) -> None:
        super().__init__()
        self.beta = beta
        self.data = data
        # the reference's log-probabilities: what a checkpoint keeps (saved beside the weights)
        self.reference = {"train": data.train.reference, "val": data.val.reference}

    def score_reference(self, model: torch.nn.Module, batch_size: int, runtime: Runtime) -> None:
        """Fill the reference table: the starting model's log-probability of every answer."""
        for split in (self.data.train, self.data.val):
            pairs = range(split.pairs)
            split.reference.copy_(self._logprobs(model, split, pairs, batch_size, runtime).double())

    def loss(self, model: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        x, y, reference = batch
        policy = answer_logprobs(model, x.to(device), y.to(device))
        losses, _ = dpo_loss(policy.double(), reference.to(device), self.beta)
        return losses.mean().float()

    def stats(self) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def _logprobs(
        self,
        model: torch.nn.Module,
        split: PreferenceSplit,
        pairs: Sequence[int],
        batch_size: int,
        runtime: Runtime,
    ) -> torch.Tensor:
        """The model's answer log-probabilities of these pairs' rows (eval mode), chosen and rejected alternating."""
        was_training = model.training
        model.eval()
        out = []
        for i in range(0, len(pairs), batch_size):
            x, y, _ = split.pair_batch(pairs[i : i + batch_size])
            with runtime.autocast():
                out.append(answer_logprobs(model, x.to(runtime.device), y.to(runtime.device)).cpu())
        model.train(was_training)
        return torch.cat(out) if out else torch.zeros(0)

    def score(
        self,
        model: torch.nn.Module,
        split: PreferenceSplit,
        batch_size: int,
        eval_iters: int,
        runtime: Runtime,
    ) -> PairScore:
        """Loss, accuracy and margin on eval_iters x batch_size evenly spaced pairs of `split`."""
        pairs = eval_rows(split.pairs, batch_size, eval_iters)
        policy = self._logprobs(model, split, pairs, batch_size, runtime).double()
        reference = split.reference[[r for p in pairs for r in (2 * p, 2 * p + 1)]]
        losses, margin = dpo_loss(policy, reference, self.beta)
        return PairScore(losses.mean().item(), ranked_right(margin).mean().item(), margin.mean().item())

    def scores(
        self, model: torch.nn.Module, batch_size: int, eval_iters: int, runtime: Runtime
    ) -> dict[str, float]:
        """The DPO loss on validation and training pairs, and the validation pairs' accuracy and margin."""
        val = self.score(model, self.data.val, batch_size, eval_iters, runtime)
        train = self.score(model, self.data.train, batch_size, eval_iters, runtime)
        return {
            "val_loss": val.loss,
            "train_loss": train.loss,
            "val_accuracy": val.accuracy,
            "val_margin": val.margin,
        }

    def split_windows(self, config: GPTConfig, dataset: Any, runtime: Runtime) -> tuple[int, ...]:
        return self.data.val.pairs, self.data.train.pairs

    def row_tokens(self, block_size: int) -> int:
        """Tokens a pair reads: both rows, at the training split's mean length."""
        train = self.data.train
        return max(1, round(2 * (train.tokens - train.conversations) / train.conversations))

    def describe_best(self, loss: float) -> str:
        return f"best val DPO loss {loss:.4f}"


def prepare_preferences(
    config: DataConfig,
    files: Sequence[Path],
    block_size: int,
    tokenizer: Tokenizer,
    note: Callable[[str], None] = lambda message: None,
) -> PreferenceData:
    """Read, check and render the preference files (and config.val_file) with the chat template of
    `tokenizer` (a fine-tuned run's, given the chat tokens)."""
    template = ChatTemplate(tokenizer)

    def read(path: Path, skipped: Skipped | None) -> Iterator[Pair]:
        return read_records(path, lambda line: parse_pair(line, template, block_size), skipped)

    train, val, inputs, skipped = read_splits(config, files, read, "preference pair", note)
    lengths = tokenizer.text_byte_lengths()
    t, v = PreferenceSplit.of_pairs(train), PreferenceSplit.of_pairs(val)
    data = PreferenceData(
        tokenizer, t, v, predicted_bytes(v, lengths), predicted_bytes(t, lengths), inputs, skipped
    )
    note(f"preference pairs: {data.summary}")
    return data
