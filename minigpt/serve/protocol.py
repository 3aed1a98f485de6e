"""OpenAI's completions protocol as served here: request fields, limits, response and error bodies."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from minigpt.errors import MinigptError
from minigpt.generate.decode import Sampling, encode_prompt
from minigpt.serve.batcher import Job, Piece, TokenLogprob
from minigpt.serve.config import CHARS_PER_TOKEN_CAP, Limits
from minigpt.tokenizer.base import Tokenizer

__all__ = [
    "ApiError",
    "AttentionRequest",
    "CompletionRequest",
    "Limits",
    "chunk_body",
    "completion_body",
    "encode_checked",
    "error_body",
    "head",
    "logprobs_body",
    "make_jobs",
    "usage",
]

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # held-back text is searched against every stop string at every token
MAX_LOGPROBS = 5  # OpenAI's limit for the completions API
MAX_PROMPTS = 64  # prompts in one request (lm-evaluation-harness batches, langchain's batch())


class ApiError(Exception):
    """A request the server answers with an OpenAI-shaped JSON error."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(value: Any) -> Any:
    """`prompt` as OpenAI takes it, as a list of prompts: a string, a list of strings, a list of token ids,
    or a list of lists of token ids. Any other JSON value is a ValueError (a 400), never a TypeError."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_id(x) for x in value):
        return [value]
    strings = isinstance(value, list) and all(isinstance(p, str) for p in value)
    ids_lists = isinstance(value, list) and all(
        isinstance(p, list) and p and all(_is_id(x) for x in p) for p in value
    )
    if not (value and (strings or ids_lists)):
        given = "" if isinstance(value, list) else f", not {_json_kind(value)}"
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
            f"none of them empty lists{given}"
        )
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"holds {len(value)} prompts; at most {MAX_PROMPTS} go in one request")
    return value


def _json_kind(value: Any) -> str:
    """What a JSON value other than a list is, in an error message."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _stops(value: Any) -> Any:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ValueError(f"give at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stops


class _Strict(BaseModel):
    # OpenAI refuses fields it does not know: a misspelt max_token must not pass silently
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """The fields both endpoints share, OpenAI's defaults included; `top_k` is an extension."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, strict=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, strict=False)
    top_k: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: Annotated[list[str], BeforeValidator(_stops)] = []
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(0.0, strict=False)
    presence_penalty: float = Field(0.0, strict=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> dict[str, bool]:
        """Fields OpenAI has that this server does not implement, and whether each was given non-neutral."""
        return {
            "frequency_penalty": self.frequency_penalty != 0,
            "presence_penalty": self.presence_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }


class CompletionRequest(SamplingRequest):
    """The fields of POST /v1/completions."""

    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)] = [""]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        """Fields this server does not implement are refused unless neutral."""
        unsupported = {
            **self.unsupported(),
            "best_of": self.best_of not in (None, self.n),
            "suffix": self.suffix is not None,
        }
        for name, given in unsupported.items():
            if given:
                raise ValueError(f"{name} is not supported by minigpt serve")
        return self


class AttentionRequest(_Strict):
    """POST /v1/attention: what each head attends to from one position of `text` (`minigpt attention`)."""

    model: str | None = None
    text: str = Field(min_length=1)
    position: int = -1


def make_jobs(req: CompletionRequest, tokenizer: Tokenizer, block_size: int, limits: Limits) -> list[Job]:
    """The decoding jobs a valid request asks for, one per prompt, in order; ApiError (400) for what
    exceeds the server's limits or the model's context and vocabulary."""
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens > limits.max_tokens:
        raise ApiError(
            400, f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens}", "max_tokens"
        )
    if req.n > limits.max_n:
        raise ApiError(400, f"n is {req.n}; this server allows at most {limits.max_n}", "n")
    seed = secrets.randbits(31) if req.seed is None else req.seed
    sampling = Sampling(req.temperature, req.top_k, None if req.top_p == 1 else req.top_p, seed)
    jobs = []
    for i, prompt in enumerate(req.prompt):
        if isinstance(prompt, str):
            ids, text = encode_checked(tokenizer, prompt, block_size, "prompt"), prompt
        else:
            ids, text = _checked_ids(tokenizer, prompt, block_size), tokenizer.decode(prompt)
        jobs.append(
            Job(ids, n=req.n, max_tokens=max_tokens, sampling=sampling, stop=req.stop, logprobs=req.logprobs,
                echo=text if req.echo else None, first_index=i * req.n)
        )  # fmt: skip
    return jobs


def _checked_ids(tokenizer: Tokenizer, ids: list[int], block_size: int) -> list[int]:
    """A token-id prompt, checked to be ids of the model's tokenizer that fit in its context."""
    bad = next((i for i in ids if not (0 <= i < tokenizer.vocab_size and _decodes(tokenizer, i))), None)
    if bad is not None:
        raise ApiError(
            400, f"prompt holds token id {bad}, which is not in this model's vocabulary (0..{tokenizer.vocab_size - 1})",
            "prompt",
        )  # fmt: skip
    if len(ids) > block_size:
        raise ApiError(
            400, f"the prompt is {len(ids)} tokens: the model's context is {block_size} tokens", "prompt"
        )
    return ids


def _decodes(tokenizer: Tokenizer, token: int) -> bool:
    try:
        tokenizer.decode_bytes([token])
        return True
    except MinigptError:
        return False


def encode_checked(tokenizer: Tokenizer, text: str, block_size: int, param: str) -> list[int]:
    """Ids of `text` (an empty text starts as `minigpt generate` does), or ApiError when it does not fit."""
    too_long = f"the model's context is {block_size} tokens"
    if len(text) > CHARS_PER_TOKEN_CAP * block_size:
        raise ApiError(400, f"{param} is {len(text):,} characters, far longer than fits: {too_long}", param)
    try:
        ids = encode_prompt(tokenizer, text)
    except MinigptError as e:
        raise ApiError(400, f"{param}: {e}", param) from None
    if len(ids) > block_size and param == "prompt":
        raise ApiError(400, f"the prompt is {len(ids)} tokens: {too_long}", param)
    return ids


# --- responses ------------------------------------------------------------------------------------------


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "end_of_text" else reason  # OpenAI says stop for a natural end too


def logprobs_body(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [None if e.logprob is None else _finite(e.logprob) for e in entries],
        "top_logprobs": [
            None if e.top is None else {k: _finite(v) for k, v in e.top.items()} for e in entries
        ],
        "text_offset": [e.offset for e in entries],
    }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI uses -9999 too


def head(model: str) -> dict[str, Any]:
    """The fields every completion body and chunk of one response share."""
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }


def usage(jobs: Sequence[Job]) -> dict[str, int]:
    completion = sum(c.tokens for job in jobs for c in job.choices)
    prompt = sum(len(job.prompt_ids) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk_body(first: dict[str, Any], piece: Piece, with_logprobs: bool) -> dict[str, Any]:
    choice = {
        "text": piece.text,
        "index": piece.index,
        "logprobs": logprobs_body(piece.logprobs) if with_logprobs else None,
        "finish_reason": _finish(piece.finish_reason),
    }
    return {**first, "choices": [choice]}


def completion_body(
    first: dict[str, Any], jobs: Sequence[Job], logprobs: dict[int, list[TokenLogprob]]
) -> dict[str, Any]:
    """The whole response: every job's choices in order (prompt by prompt, n each), the prompt in front of
    each where the request asked for echo; `logprobs` by choice index."""
    choices = [
        {
            "text": (job.echo or "") + c.stream.text,
            "index": job.first_index + i,
            "logprobs": logprobs_body(logprobs.get(job.first_index + i, []))
            if job.logprobs is not None
            else None,
            "finish_reason": _finish(c.stream.finish_reason) or "length",
        }
        for job in jobs
        for i, c in enumerate(job.choices)
    ]
    return {**first, "choices": choices, "usage": usage(jobs)}
