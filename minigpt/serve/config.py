"""What `minigpt serve` serves and how (each field of `ServeConfig` an option of the command), and the limits
one request must keep. Plain data: no FastAPI, no pydantic, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.common.settings import check_bounds, setting

__all__ = ["Limits", "ServeConfig"]


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: tokens per choice and choices per request."""

    max_tokens: int = 1024
    max_n: int = 16


@dataclass(frozen=True)
class ServeConfig:
    """The runs beside the first, where the server listens, who may use it, and how much it takes on."""

    models: list[Path] | None = setting(
        None, "Another run to serve (repeatable); a request picks one by folder name.", flags=("--model", "-m"),
        metavar="RUN",
    )  # fmt: skip
    host: str = setting(
        "127.0.0.1", "Address to listen on: 127.0.0.1 keeps the server to this machine; 0.0.0.0 opens it to the "
        "network (then use --api-key behind a TLS proxy).",
    )  # fmt: skip
    port: int = setting(8000, "Port to listen on (0: any free one).", min=0, max=65535)
    api_key: str | None = setting(
        None, "Require `Authorization: Bearer KEY` on every /v1 route.", envvar="MINIGPT_API_KEY"
    )
    max_batch: int = setting(32, "Rows (samples of all requests) decoded together at most; caps n.", min=1)
    queue: int = setting(64, "Requests that may wait for free rows; past that, 429 (busy).", min=0)
    max_tokens: int = setting(1024, "The largest max_tokens a request may ask for.", min=1)

    def __post_init__(self) -> None:
        check_bounds(self)

    @property
    def limits(self) -> Limits:
        """What one request may ask for: n up to the rows decoded together."""
        return Limits(max_tokens=self.max_tokens, max_n=self.max_batch)
