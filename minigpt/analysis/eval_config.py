"""How `minigpt eval` scores a run (each field an option of the command); no torch."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.common.settings import check_bounds, setting
from minigpt.feedback.rewards import EXACT, REWARD_CHOICES


@dataclass(frozen=True)
class EvalConfig:
    """How many windows are scored, how many at a time, in which precision, and how the text is read."""

    batch_size: int = setting(16, "Windows per forward pass.", min=1)
    max_windows: int | None = setting(
        None, "Score at most this many evenly spaced windows (default: all).", min=1
    )
    encoding: str = setting("utf-8", "Text encoding of the files.")
    dtype: str = setting("float32", "auto, float32, bfloat16 or float16.")
    # tasks (the JSONL `train --reward` reads): answers generated and scored, not a loss
    reward: str = setting(EXACT, f"Tasks: how answers are scored, as train's --reward: {REWARD_CHOICES}.")
    answer_tokens: int = setting(32, "Tasks: the longest answer, in tokens.", min=1)
    samples: int = setting(
        1, "Tasks: also sample this many answers to each and report pass@k (the best of them; 1: greedy "
        "answers only).", min=1,
    )  # fmt: skip
    temperature: float = setting(1.0, "Tasks: the temperature --samples draws at.", min=0, shown="1.0")
    seed: int = setting(0, "Tasks: the random seed --samples draws with.", min=0)

    def __post_init__(self) -> None:
        check_bounds(self)
