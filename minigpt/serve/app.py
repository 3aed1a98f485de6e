"""The FastAPI application: OpenAI-compatible routes, the attention and run views, the page and its files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from minigpt.chat.template import has_chat_tokens
from minigpt.common.strict_json import JsonError, parse_json
from minigpt.errors import MinigptError
from minigpt.serve.batcher import Job, Piece, QueueFull, TokenLogprob, Update, notify_each
from minigpt.serve.chat import ChatRequest, chat_body, chat_chunk, chat_head, make_chat_job, role_chunk
from minigpt.serve.config import body_cap
from minigpt.serve.models import ServedModel
from minigpt.serve.protocol import (
    ApiError,
    AttentionRequest,
    CompletionRequest,
    Limits,
    chunk_body,
    completion_body,
    error_body,
    head,
    make_jobs,
    usage,
)

__all__ = ["create_app"]

STATIC = Path(__file__).with_name("static")
# a body past this is parsed and its prompts tokenized on a worker thread, not on the event loop
INLINE_BODY = 64 << 10
log = logging.getLogger("minigpt.serve")
R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")


@dataclass
class State:
    """What the routes share: the models by id, the request limits, the API key (None: no auth) and the
    largest request body taken, in bytes."""

    models: dict[str, ServedModel]
    limits: Limits
    api_key: str | None
    max_body: int

    def model(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ApiError(400, f"model is required: one of {', '.join(self.models)}", "model")
        if name not in self.models:
            raise ApiError(404, f"no model {name!r} here: this server has {', '.join(self.models)}", "model")
        return self.models[name]


def _state(request: Request) -> State:
    return request.app.state.minigpt


async def _check_key(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(
            401, "missing or wrong API key: send Authorization: Bearer <key>", kind="authentication_error"
        )


api = APIRouter(prefix="/v1", dependencies=[Depends(_check_key)])


@api.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    data = [
        {"id": m.id, "object": "model", "created": int(m.run.modified()), "owned_by": "minigpt",
         "context_length": m.engine.block_size, "chat": has_chat_tokens(m.tokenizer)}
        for m in _state(request).models.values()
    ]  # fmt: skip
    return {"object": "list", "data": data}


async def _body(request: Request, cap: int) -> bytes:
    """The request's body, refused with a 413 once past `cap` bytes: by the length it declares before any
    of it is read, else as it arrives."""
    declared = request.headers.get("content-length", "")
    if len(declared) > 20 or declared.isascii() and declared.isdigit() and int(declared) > cap:
        raise _too_large(cap)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(cap: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({cap:,} bytes; see --max-body)")


def _validated(body: bytes, model: type[R]) -> R:
    """The body read strictly (`parse_json`) into `model`; ApiError or a validation error (both a 400)."""
    try:
        data = parse_json(body)
    except JsonError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def _read(request: Request, model: type[R], prepare: Callable[[R], T]) -> tuple[R, T]:
    """The request's body (past the server's cap, a 413 unread) as `model`, and `prepare` of it (its jobs
    made: prompts tokenized). A large body is read and prepared on a worker thread, so that megabytes of
    JSON never hold up the event loop and the other requests it serves (/health included)."""
    body = await _body(request, _state(request).max_body)

    def work() -> tuple[R, T]:
        req = _validated(body, model)
        return req, prepare(req)

    return await asyncio.to_thread(work) if len(body) > INLINE_BODY else work()


@api.post("/completions")
async def completions(request: Request) -> Response:
    state = _state(request)

    def prepare(req: CompletionRequest) -> tuple[ServedModel, list[Job]]:
        served = state.model(req.model)
        return served, make_jobs(req, served.tokenizer, served.engine.block_size, state.limits)

    req, (served, jobs) = await _read(request, CompletionRequest, prepare)
    updates = _channel(jobs)
    try:
        served.batcher.submit(*jobs)
    except QueueFull as e:
        raise ApiError(429, str(e), kind="rate_limit_error") from None
    first = head(served.id)
    if req.stream:
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(
            _sse(served, jobs, updates, first, with_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _complete(served, jobs, updates, first, request)


@api.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)

    def prepare(req: ChatRequest) -> tuple[ServedModel, list[Job]]:
        served = state.model(req.model)
        return served, [make_chat_job(req, served.tokenizer, served.engine.block_size, state.limits)]

    req, (served, jobs) = await _read(request, ChatRequest, prepare)
    updates = _channel(jobs)
    try:
        served.batcher.submit(*jobs)
    except QueueFull as e:
        raise ApiError(429, str(e), kind="rate_limit_error") from None
    if req.stream:
        first = chat_head(served.id, chunk=True)
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        opening = [role_chunk(first, i) for i in range(req.n)]
        return StreamingResponse(
            _sse(served, jobs, updates, first, with_usage, chat_chunk, opening),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    first = chat_head(served.id, chunk=False)
    return await _complete(served, jobs, updates, first, request,
                           lambda logprobs: chat_body(first, jobs[0], logprobs, usage(jobs)))  # fmt: skip


@api.post("/attention")
async def attention(request: Request) -> dict[str, Any]:
    req, served = await _read(request, AttentionRequest, lambda req: _state(request).model(req.model))
    # the first call may import torch and load the model: seconds the event loop must not wait
    return await asyncio.to_thread(served.attention, req.text, req.position)


@api.get("/runs/{model}")
async def run_info(model: str, request: Request) -> dict[str, Any]:
    return await asyncio.to_thread(_state(request).model(model).run_info)


def _channel(jobs: list[Job]) -> asyncio.Queue[Update]:
    """A queue that receives the jobs' updates (put on this event loop by `_deliverer`'s callback)."""
    queue: asyncio.Queue[Update] = asyncio.Queue()
    for job in jobs:
        job.notify = queue.put_nowait
    return queue


def _deliverer(loop: asyncio.AbstractEventLoop) -> Callable[[list[tuple[Job, Update]]], None]:
    """The batcher's `deliver`: hands a round's updates to their jobs on the event loop, in one wake-up."""

    def deliver(updates: list[tuple[Job, Update]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
            loop.call_soon_threadsafe(notify_each, updates)

    return deliver


async def _updates(queue: asyncio.Queue[Update], jobs: int) -> AsyncIterator[Update]:
    """The updates of a request's `jobs` jobs, until every one is done."""
    while jobs:
        update = await queue.get()
        if update.error is not None:
            kind = "server_error" if update.status >= 500 else "invalid_request_error"
            raise ApiError(update.status, update.error, kind=kind)
        yield update
        jobs -= update.done


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _sse(
    served: ServedModel,
    jobs: list[Job],
    queue: asyncio.Queue[Update],
    first: dict[str, Any],
    with_usage: bool,
    chunk: Callable[[dict[str, Any], Piece, bool], dict[str, Any]] = chunk_body,
    opening: Sequence[dict[str, Any]] = (),
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format (`chunk`: completions' or chat's), the `opening` chunks
    first, one choice per chunk, then `data: [DONE]`."""
    with_logprobs = jobs[0].logprobs is not None
    try:
        for body in opening:
            yield _event(body)
        async for update in _updates(queue, len(jobs)):
            for piece in update.pieces:
                yield _event(chunk(first, piece, with_logprobs))
        if with_usage:
            yield _event({**first, "choices": [], "usage": usage(jobs)})
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield _event(error_body(e.message, e.kind))
    finally:
        for job in jobs:  # the client left mid-stream (or it finished: then nothing to do)
            served.batcher.cancel(job)


async def _complete(
    served: ServedModel,
    jobs: list[Job],
    queue: asyncio.Queue[Update],
    first: dict[str, Any],
    request: Request,
    body: Callable[[dict[int, list[TokenLogprob]]], dict[str, Any]] | None = None,
) -> Response:
    """The whole completion as one body (`body`: chat's, given the logprobs by choice; default
    completions'); a client that hangs up first cancels the jobs."""
    logprobs: dict[int, list[TokenLogprob]] = {}

    async def collect() -> None:
        async for update in _updates(queue, len(jobs)):
            for piece in update.pieces:
                logprobs.setdefault(piece.index, []).extend(piece.logprobs)

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            for job in jobs:
                served.batcher.cancel(job)
    if work.cancelled():
        return Response(status_code=204)  # nobody is there to read it
    work.result()  # an error update raises here
    return JSONResponse(completion_body(first, jobs, logprobs) if body is None else body(logprobs))


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- errors: always OpenAI's JSON shape, never a traceback -----------------------------------------------


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return _error(e.status, e.message, e.kind, e.param)


async def _user_error(request: Request, e: Exception) -> Response:
    return _error(400, str(e))


async def _invalid(request: Request, e: Exception) -> Response:
    """A request's validation errors as one OpenAI error: the first problem, named by its field."""
    assert isinstance(e, RequestValidationError)
    first = e.errors()[0] if e.errors() else {}
    loc = [str(part) for part in first.get("loc", ())]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif not loc and kind != "value_error":
        message = "the request body must be a JSON object"
    else:
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"{param}: {detail}" if param else detail
    return _error(400, message, param=param)


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    return _error(e.status_code, str(e.detail))


async def _internal(request: Request, e: Exception) -> Response:
    return _error(500, "internal server error (see the server log)", "server_error")


# --- the application -------------------------------------------------------------------------------------


def create_app(
    models: Sequence[ServedModel], limits: Limits = Limits(), api_key: str | None = None
) -> FastAPI:
    """The server for these models; their batchers run while the application does (its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for m in models:
            m.batcher.deliver = _deliverer(asyncio.get_running_loop())
            m.batcher.start()
        try:
            yield
        finally:
            for m in models:
                m.batcher.stop()

    # no /docs: FastAPI's pages load their scripts from a CDN, and the page here must work offline
    app = FastAPI(title="minigpt serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    max_body = limits.max_body or max(body_cap(m.engine.block_size) for m in models)
    app.state.minigpt = State({m.id: m for m in models}, limits, api_key, max_body)
    for error, handler in (
        (ApiError, _api_error),
        (MinigptError, _user_error),
        (RequestValidationError, _invalid),
        (HTTPException, _http_error),
        (Exception, _internal),
    ):
        app.add_exception_handler(error, handler)
    app.include_router(api)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_api_route("/", lambda: FileResponse(STATIC / "index.html"), include_in_schema=False)
    app.add_api_route("/health", _health, methods=["GET"])
    return app


async def _health(request: Request) -> dict[str, Any]:
    models = [
        {"id": m.id, "backend": m.engine.name, "device": m.engine.device, "dtype": m.engine.dtype,
         "active_rows": m.batcher.active_rows, "waiting": m.batcher.waiting,
         "forward_passes": m.batcher.forwards, "rows_forwarded": m.batcher.rows_forwarded,
         "rows_per_forward": round(m.batcher.rows_forwarded / max(1, m.batcher.forwards), 2)}
        for m in _state(request).models.values()
    ]  # fmt: skip
    return {"status": "ok", "models": models}
