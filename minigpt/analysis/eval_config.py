"""How `minigpt eval` scores a run (each field an option of the command); no torch."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.common.settings import check_bounds, setting


@dataclass(frozen=True)
class EvalConfig:
    """How many windows are scored, how many at a time, in which precision, and how the text is read."""

    batch_size: int = setting(16, "Windows per forward pass.", min=1)
    max_windows: int | None = setting(
        None, "Score at most this many evenly spaced windows (default: all).", min=1
    )
    encoding: str = setting("utf-8", "Text encoding of the files.")
    dtype: str = setting("float32", "auto, float32, bfloat16 or float16.")

    def __post_init__(self) -> None:
        check_bounds(self)
