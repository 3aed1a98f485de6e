"""OpenAI's chat completions protocol as served here: the request, the conversation rendered by the run's
chat template, and the response and chunk bodies. Decoding is the completions' (the same batcher, limits
and errors); an answer ends at the template's control tokens."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from minigpt.chat.template import ChatTemplate, Message
from minigpt.errors import MinigptError
from minigpt.generate.decode import Sampling
from minigpt.serve.batcher import Job, Piece, TokenLogprob
from minigpt.serve.protocol import ApiError, Limits, SamplingRequest, _finish, _finite, _Strict
from minigpt.tokenizer.base import Tokenizer

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "chat_body",
    "chat_chunk",
    "chat_head",
    "make_chat_job",
    "role_chunk",
]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_MESSAGES = 1024


def _content(value: Any) -> Any:
    """A message's content: a string, or OpenAI's list of text parts ({"type": "text", "text": "..."}) joined;
    anything else is a ValueError (a 400), an image part included."""
    if isinstance(value, str):
        return value
    if not (isinstance(value, list) and value and all(_is_text_part(p) for p in value)):
        raise ValueError(
            'must be a string or a non-empty list of text parts: {"type": "text", "text": "..."}'
        )
    return "".join(p["text"] for p in value)


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and part.keys() == {"type", "text"}
        and part["type"] == "text"
        and isinstance(part["text"], str)
    )


class ChatMessage(_Strict):
    """One message; "developer" is OpenAI's newer name for the system role."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_content)]
    name: str | None = None


class ChatRequest(SamplingRequest):
    """The fields of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        """Fields this server does not implement are refused unless neutral."""
        unsupported = {
            **self.unsupported(),
            "top_logprobs": self.top_logprobs is not None and not self.logprobs,
        }
        for name, given in unsupported.items():
            if given:
                why = (
                    "needs logprobs: true" if name == "top_logprobs" else "is not supported by minigpt serve"
                )
                raise ValueError(f"{name} {why}")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens (its older name), not both")
        return self


def make_chat_job(req: ChatRequest, tokenizer: Tokenizer, block_size: int, limits: Limits) -> Job:
    """The decoding job of a chat request: its conversation rendered and an open assistant turn; ApiError
    (400) for a conversation that does not fit or a run that cannot chat. Without max_tokens an answer may
    take the rest of the context (at most the server's limit)."""
    try:
        template = ChatTemplate(tokenizer)
    except MinigptError as e:
        raise ApiError(400, f"model: {e}", "model") from None
    messages = [Message("system" if m.role == "developer" else m.role, m.content) for m in req.messages]
    try:
        ids = template.prompt(messages)
    except MinigptError as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    if len(ids) >= block_size:
        raise ApiError(
            400,
            f"the conversation is {len(ids)} tokens: the model's context is {block_size} tokens",
            "messages",
        )
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if given is not None and given > limits.max_tokens:
        raise ApiError(400, f"{param} is {given}; this server allows at most {limits.max_tokens}", param)
    if req.n > limits.max_n:
        raise ApiError(400, f"n is {req.n}; this server allows at most {limits.max_n}", "n")
    max_tokens = given if given is not None else min(limits.max_tokens, block_size - len(ids))
    seed = secrets.randbits(31) if req.seed is None else req.seed
    sampling = Sampling(req.temperature, req.top_k, None if req.top_p == 1 else req.top_p, seed)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Job(ids, n=req.n, max_tokens=max_tokens, sampling=sampling, stop=req.stop, logprobs=logprobs,
               stop_ids=template.stop_ids)  # fmt: skip


# --- responses ------------------------------------------------------------------------------------------


def chat_head(model: str, chunk: bool) -> dict[str, Any]:
    """The fields every body or chunk of one chat response shares."""
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
    }


def logprobs_content(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's logprobs: each token with its log-probability, bytes and most likely alternatives."""

    def item(token: str, logprob: float | None) -> dict[str, Any]:
        value = None if logprob is None else _finite(logprob)  # None: a prompt's first token (never here)
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in (e.top or {}).items()]}
            for e in entries
        ]
    }


def role_chunk(head: dict[str, Any], index: int) -> dict[str, Any]:
    """A choice's first chunk, which names the speaker (as OpenAI's streams begin)."""
    delta = {"role": "assistant", "content": ""}
    return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}


def chat_chunk(head: dict[str, Any], piece: Piece, with_logprobs: bool) -> dict[str, Any]:
    choice = {
        "index": piece.index,
        "delta": {"content": piece.text} if piece.text else {},
        "logprobs": logprobs_content(piece.logprobs) if with_logprobs else None,
        "finish_reason": _finish(piece.finish_reason),
    }
    return {**head, "choices": [choice]}


def chat_body(
    head: dict[str, Any], job: Job, logprobs: dict[int, list[TokenLogprob]], usage: dict[str, int]
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c.stream.text},
            "logprobs": logprobs_content(logprobs.get(i, [])) if job.logprobs is not None else None,
            "finish_reason": _finish(c.stream.finish_reason) or "length",
        }
        for i, c in enumerate(job.choices)
    ]
    return {**head, "choices": choices, "usage": usage}
