"""What `minigpt serve` serves and how (each field of `ServeConfig` an option of the command), and the limits
one request must keep. Plain data: no FastAPI, no pydantic, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minigpt.common.settings import check_bounds, setting
from minigpt.data.config import parse_size

__all__ = ["CHARS_PER_TOKEN_CAP", "Limits", "ServeConfig", "body_cap"]

MAX_ROWS = 4096  # --max-batch at most: far past any batch one machine decodes at once
# a character cap checked before tokenizing, far above any prompt that fits in the context
CHARS_PER_TOKEN_CAP = 64
# JSON bytes of one character at its longest (\uXXXX), and room for a request's other fields
ESCAPED_CHAR_BYTES = 6
BODY_SLACK = 1 << 20


def body_cap(block_size: int) -> int:
    """The default cap on a request body for a model of `block_size` positions: a prompt or conversation
    filling the context, each token CHARS_PER_TOKEN_CAP characters escaped at their longest, and BODY_SLACK."""
    return BODY_SLACK + block_size * CHARS_PER_TOKEN_CAP * ESCAPED_CHAR_BYTES


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: tokens per choice, choices per request, and bytes of its body (None:
    `body_cap` of the largest context served)."""

    max_tokens: int = 1024
    max_n: int = 16
    max_body: int | None = None


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
    # past MAX_ROWS, one request's n could ask for a KV cache of any size
    max_batch: int = setting(
        32, "Rows (samples of all requests) decoded together at most; caps n.", min=1, max=MAX_ROWS
    )
    queue: int = setting(64, "Requests that may wait for free rows; past that, 429 (busy).", min=0)
    max_tokens: int = setting(1024, "The largest max_tokens a request may ask for.", min=1)
    max_body: int | None = setting(
        None, "The largest request body, e.g. 16MB: a larger one is refused (413) unread. Default: room for "
        "the largest context served, written out at its longest, and 1MB.", parse=parse_size, metavar="<size>",
        min=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_bounds(self)

    @property
    def limits(self) -> Limits:
        """What one request may ask for: n up to the rows decoded together."""
        return Limits(max_tokens=self.max_tokens, max_n=self.max_batch, max_body=self.max_body)
