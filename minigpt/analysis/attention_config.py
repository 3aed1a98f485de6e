"""What `minigpt attention` looks at (each field an option of the command); plain data, no torch, so the
CLI builds its options without importing `minigpt.analysis.attention`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.common.settings import check_bounds, setting
from minigpt.errors import UsageError


@dataclass(frozen=True)
class AttentionConfig:
    """Which position, layer and head `minigpt attention` shows, how many top tokens, and where a PNG goes."""

    position: int | None = setting(
        None, "Query position to show (default: the last token; negative counts from the end)."
    )
    layer: int | None = setting(
        None, "Draw this layer's full T x T patterns as grids (negative from the end)."
    )
    head: int | None = setting(None, "With --layer: only this head.")
    top: int = setting(3, "Top attended tokens listed per head.", min=1)
    png: Path | None = setting(
        None, "Also draw the grid (one head, or a tile of heads) as a PNG (needs the viz extra)."
    )

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.head is not None and self.layer is None:
            raise UsageError("--head needs --layer: give both, e.g. --layer 0 --head 1")
