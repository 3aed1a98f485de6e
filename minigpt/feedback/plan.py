"""Which objective a run's data calls for: the kind of its JSONL records, the settings only one kind takes,
the data read for it, the objective built, and the memory it needs beside the model's state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from minigpt.chat.data import ConversationData, prepare_conversations
from minigpt.common.settings import options_of
from minigpt.data.dataset import DataConfig, Dataset
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
from minigpt.train.config import TrainConfig
from minigpt.train.objective import NextToken, Objective
from minigpt.train.step import Runtime

# the settings only one kind of data takes
SETTINGS_OF = {
    PREFERENCES: ("dpo_beta",),
    TASKS: ("reward", "group_size", "answer_tokens", "temperature", "kl_coef", "reward_timeout"),
}


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
