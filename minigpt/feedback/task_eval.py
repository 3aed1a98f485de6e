"""`minigpt eval RUN tasks.jsonl`: the mean reward of a run's greedy answers to tasks (with the exact-match
reward, the share answered exactly), and with --samples k, pass@k: the mean over tasks of the best reward
among k sampled answers (for a 0/1 reward, the share of tasks that at least one of them solves).

The tasks are the JSONL `minigpt train --init-from RUN tasks.jsonl` learns from, read and checked the same
way, and answered through the same decode loop, so a gain is measured the same way everywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from minigpt.analysis.eval_config import EvalConfig
from minigpt.chat.data import conversation_files, read_records
from minigpt.chat.template import ChatTemplate
from minigpt.errors import MinigptError, UsageError
from minigpt.feedback.answers import answer
from minigpt.feedback.records import PREFERENCES, TASKS, Task, files_kind, parse_task
from minigpt.feedback.rewards import EXACT, make_reward
from minigpt.generate.decode import Sampling
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.runs.folder import RunDir

# seconds a module:function reward may take on one answer (train's --reward-timeout default)
REWARD_TIMEOUT = 10.0


def holds_tasks(files: list[Path], cfg: EvalConfig) -> bool:
    """Whether `files` are tasks (JSONL whose records have an answer, or any prompts given a --reward other
    than exact); preference pairs are refused: eval has no reference model to weigh them against."""
    chats = conversation_files(files)
    kind = files_kind(chats, cfg.reward != EXACT) if chats is not None else None
    if kind == PREFERENCES:
        raise UsageError(
            f"{chats[0] if chats else files[0]} holds preference pairs: eval scores text, conversations and tasks "
            f"(a DPO run reports its pairs' accuracy as it trains)"
        )
    return kind == TASKS


@dataclass(frozen=True)
class TaskScore:
    tasks: int
    reward: str  # the reward's name
    greedy: float  # mean reward of the greedy answers
    samples: int  # k
    pass_at_k: float | None  # mean best reward of k sampled answers (None: k = 1)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def evaluate_tasks(
    run: Path, files: list[Path], cfg: EvalConfig, device_name: str = "auto", quantize: str = "none"
) -> TaskScore:
    """Score a run's best weights on the tasks in `files` as `cfg` says, on `device_name`, with its linear
    layers in `quantize` form."""
    from minigpt.common.device import resolve_device
    from minigpt.model.quantize import check_quantize

    device = resolve_device(device_name)
    check_quantize(quantize, device)
    model, tokenizer, _ = RunDir(run).load_model(str(device))
    template = ChatTemplate(tokenizer)
    reward = make_reward(cfg.reward, REWARD_TIMEOUT)
    block = model.config.block_size

    def parse(line: bytes) -> Task:
        return parse_task(line, template, block, cfg.answer_tokens, reward.needs_answer)

    tasks = [t for f in files for t in read_records(f, parse, None)]
    if not tasks:
        raise MinigptError(f"{files[0]}: no tasks to answer")
    engine = TorchEngine(model, quantize)

    def mean_best(samples: int, sampling: Sampling) -> float:
        groups = answer(
            engine, tokenizer, [t.prompt for t in tasks], samples=samples, max_tokens=cfg.answer_tokens,
            stop_ids=template.stop_ids, sampling=sampling,
        )  # fmt: skip
        best = [max(reward(a.text, t) for a in g) for t, g in zip(tasks, groups, strict=True)]
        return sum(best) / max(1, len(best))

    greedy = mean_best(1, Sampling(temperature=0.0))
    sampled = mean_best(cfg.samples, Sampling(cfg.temperature, seed=cfg.seed)) if cfg.samples > 1 else None
    return TaskScore(len(tasks), reward.name, greedy, cfg.samples, sampled)
