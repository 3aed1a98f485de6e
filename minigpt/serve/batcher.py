"""The server's decoder: one worker thread steps every active request's rows together, sharing the model."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minigpt.errors import MinigptError
from minigpt.generate.decode import Engine, Sampling, TextStream, resolve_slide, window_drop
from minigpt.model.kvcache import KVCache
from minigpt.serve.scoring import prompt_log_probs
from minigpt.tokenizer.base import Tokenizer

__all__ = ["Batcher", "Job", "Piece", "QueueFull", "TokenLogprob", "Update", "notify_each"]

log = logging.getLogger("minigpt.serve")


class QueueFull(MinigptError):
    """Every decoding row is taken and the waiting queue is full: the client should retry later."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token: its text, log-probability, the most likely alternatives, where its text starts. A prompt's
    first token has no log-probability (nothing comes before it): None, as OpenAI's API gives it."""

    token: str
    logprob: float | None
    top: dict[str, float] | None
    offset: int


@dataclass(frozen=True)
class Piece:
    """Text of one choice that became safe to show; `finish_reason` is set on the choice's last piece."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Update:
    """What one decoding round produced for a job, handed to the job's `notify`; an `error` ends the job,
    with the HTTP `status` its request gets."""

    pieces: list[Piece]
    done: bool = False
    error: str | None = None
    status: int = 500


class Choice:
    """One sample of a job: its streamed text, token count and the log-probabilities not yet shown."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stream = TextStream(stop)
        self.tokens = 0
        self.pending: list[TokenLogprob] = []


class Job:
    """One prompt of a request: `n` samples, decoded as n adjacent rows with the request's own sampling
    settings and random generator, so its tokens do not depend on which other requests share the batch.

    With `echo` each choice starts with the prompt's text (and, with `logprobs`, its tokens' scores);
    `max_tokens` 0 then scores the prompt without generating. `first_index` numbers the job's choices
    among all of its request's (a request of several prompts has a job for each)."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        sampling: Sampling,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        echo: str | None = None,
        first_index: int = 0,
        stop_ids: Collection[int] = (),
        notify: Callable[[Update], None] = lambda update: None,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.stop_ids = frozenset(stop_ids)  # tokens besides <|endoftext|> that end a choice (a chat turn's)
        self.n = n
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.logprobs = logprobs
        self.echo = echo  # the prompt's text, when the choices start with it
        self.first_index = first_index
        self.notify = notify
        self.choices = [Choice(stop) for _ in range(n)]
        self.steps = 0
        self.cancelled = False
        self.submitted = 0.0
        self.rng: Any = None  # the engine's generator, made on admission

    @property
    def done(self) -> bool:
        return all(c.stream.done for c in self.choices)


@dataclass
class _Group:
    """Rows that one forward pass steps together: each job's n rows in turn, each row at its own position
    once prefilled (a job's rows share theirs).

    `cache` is None until the rows are prefilled, and again after their windows slid (a re-prefill).
    """

    jobs: list[Job]
    windows: list[list[int]]
    cache: KVCache[Any] | None = None
    logits: Any = None
    tokens: list[int] = field(default_factory=list)

    def key(self) -> tuple[bool, int]:
        """Groups with one key can share their next forward: prefills of one length, or one-token steps
        (each row at its own position: the cache's rows need not share one)."""
        if self.cache is None:
            return True, len(self.windows[0])
        return False, 0


class Batcher:
    """Decodes the requests of one model in a worker thread, batching the rows that can share a forward pass.

    Requests admitted together with prompts of one length are prefilled as one batch (a prefill's rows
    share their positions); once prefilled, every request's rows decode in one group, whatever position
    each has reached: the engines' KV cache keeps a position per row, and a one-token step writes each
    row's key into its own slot and lets each row attend to its own (`KVCache.key_mask`), so a request that
    started later, or with a longer prompt, joins the others' forward pass at its next step (its cache
    rows stacked onto theirs). Each round samples every group's next tokens, then runs one forward pass
    per group: the decoding rows, and any prefills admitted that round. A finished or cancelled request
    leaves its group at the next round, and one whose window slides (learned positions past block_size)
    leaves it to be read again; at most `max_rows` rows decode at once, and at most `max_waiting` requests
    wait for room beyond them (`submit` raises QueueFull past that).

    Waiting requests are admitted once the oldest has waited `admit_wait` seconds (or they fill the free
    rows), so requests sent together start together. Each round's updates go out in one call of
    `deliver` (the server's wakes its event loop once per round, not once per request).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        max_rows: int = 32,
        max_waiting: int = 64,
        slide: int | None = None,
        admit_wait: float = 0.0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.max_waiting = max_waiting
        self.slide = resolve_slide(slide, engine.block_size)
        self.admit_wait = admit_wait
        self.deliver: Callable[[list[tuple[Job, Update]]], None] = notify_each
        self.active_rows = 0
        self.forwards = 0  # forward passes run, and the rows they carried: how well requests batch
        self.rows_forwarded = 0
        self.groups: list[_Group] = []
        self._waiting: deque[Job] = deque()
        self._outbox: list[tuple[Job, Update]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- the request side (any thread) -------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs for decoding (one request's, all or none); QueueFull when some would have to wait and
        the queue has no room for them."""
        for job in jobs:
            if job.n > self.max_rows:
                raise MinigptError(
                    f"n={job.n} is more than the {self.max_rows} rows this server decodes at once"
                )
        with self._wake:
            if self._beyond_rows(jobs) > self.max_waiting:
                raise QueueFull(
                    f"the server is busy: {self.active_rows} rows are decoding and {len(self._waiting)} "
                    f"requests are waiting; retry later"
                )
            for job in jobs:
                job.submitted = time.monotonic()
                self._waiting.append(job)
            self._wake.notify()

    def _beyond_rows(self, new: Sequence[Job] = ()) -> int:
        """How many waiting jobs (and `new` ones after them) the next admission cannot take: those before
        them fit in the free rows."""
        free = self.max_rows - self.active_rows
        queue = [*self._waiting, *new]
        for i, job in enumerate(queue):
            if job.n > free:
                return len(queue) - i
            free -= job.n
        return 0

    def cancel(self, job: Job) -> None:
        """Stop a job (its client left): a waiting one leaves the queue now, an active one next round."""
        job.cancelled = True
        with self._wake:
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="minigpt-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker; jobs still decoding get an error update."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._fail_all("the server is shutting down")

    # --- the worker ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self.groups or self._ready()):
                    self._wake.wait(self._until_ready())
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug, not a bad request: keep serving the others
                log.exception("decoding failed")
                self._fail_all("internal error while decoding (see the server log)")
            # a step holds the GIL throughout (one compiled call): hand it to the event loop now, so it sends
            # this step's text and takes new requests at once rather than after Python's thread switch
            # interval (sys.getswitchinterval): clients that get their last chunk late send their next
            # request late
            time.sleep(0)

    def step(self) -> None:
        """One round: sample each group's next tokens, retire the jobs that ended, admit what now fits, then
        one forward pass per group (merged where positions meet)."""
        slid = []
        for group in self.groups:
            if group.logits is not None:
                self._sample(group)
            self._retire(group)
            slid += self._advance(group)
        self.groups += slid
        self._admit()
        self.groups = self._merge([g for g in self.groups if g.jobs])
        for group in self.groups:
            group.logits = self._forward(group)
        outbox, self._outbox = self._outbox, []
        if outbox:
            self.deliver(outbox)

    def _ready(self) -> bool:
        """Whether waiting jobs should be admitted now: the oldest has waited long enough, or they fill
        every free row anyway (call with the lock held)."""
        if not self._waiting:
            return False
        waited = time.monotonic() - self._waiting[0].submitted >= self.admit_wait
        return waited or sum(j.n for j in self._waiting) >= self.max_rows - self.active_rows

    def _until_ready(self) -> float | None:
        if not self._waiting:
            return None
        return max(0.0, self._waiting[0].submitted + self.admit_wait - time.monotonic())

    def _admit(self) -> None:
        with self._wake:
            if not self._ready():
                return
            admitted = []
            while self._waiting and self.active_rows + self._waiting[0].n <= self.max_rows:
                job = self._waiting.popleft()
                if job.max_tokens > 0:
                    self.active_rows += job.n
                admitted.append(job)
        self._echo([job for job in admitted if job.echo is not None])
        for job in admitted:
            if job.max_tokens == 0:  # scored (or echoed) only: done without a row
                self._finish(job)
                continue
            job.rng = self.engine.rng(job.sampling.seed)
            self.groups.append(_Group([job], [list(job.prompt_ids) for _ in range(job.n)]))

    def _echo(self, jobs: list[Job]) -> None:
        """Post each job's prompt as its choices' first text, scored where the job asks for logprobs: prompts
        of one length are scored together, one forward pass per position."""
        scored = [job for job in jobs if job.logprobs is not None]
        by_length: dict[int, list[Job]] = {}
        for job in scored:
            by_length.setdefault(len(job.prompt_ids), []).append(job)
        entries: dict[int, list[TokenLogprob]] = {}
        for group in by_length.values():
            logp = prompt_log_probs(self.engine, [job.prompt_ids for job in group])
            for job, rows in zip(group, logp, strict=True):
                entries[id(job)] = _prompt_logprobs(rows, job.prompt_ids, job.logprobs or 0, self.tokenizer)
        for job in jobs:
            pieces = [
                Piece(job.first_index + i, job.echo or "", None, entries.get(id(job), []))
                for i in range(job.n)
            ]
            self._outbox.append((job, Update(pieces)))

    def _finish(self, job: Job) -> None:
        """End a job that generates nothing (max_tokens 0)."""
        for choice in job.choices:
            choice.stream.close("length")
        pieces = [Piece(job.first_index + i, "", "length", []) for i in range(job.n)]
        self._outbox.append((job, Update(pieces, done=True)))

    def _sample(self, group: _Group) -> None:
        group.tokens = []
        row = 0
        for job in group.jobs:
            logits = group.logits[row : row + job.n]
            row += job.n
            if job.cancelled:
                group.tokens += [0] * job.n  # never shown: the job leaves before the next forward
                continue
            s = job.sampling
            try:
                picks = self.engine.sample(logits, s.temperature, s.top_k, s.top_p, job.rng)
            except (ArithmeticError, RuntimeError, ValueError) as e:  # torch's, for NaN or infinite logits
                self._refuse(job, f"cannot draw the next token from this request's scores ({e})")
                group.tokens += [0] * job.n
                continue
            group.tokens += picks
            self._emit(job, picks, logits)

    def _refuse(self, job: Job, message: str) -> None:
        """End a job whose own rows cannot go on (its numbers, not the batch's): a 400 for its request alone,
        its rows leaving the group at this round's retirement."""
        log.warning("request refused while decoding: %s", message)
        job.cancelled = True
        self._outbox.append((job, Update([], done=True, error=message, status=400)))

    def _emit(self, job: Job, picks: list[int], logits: Any) -> None:
        """Feed a job's new tokens to its choices and post the text that became safe to show."""
        job.steps += 1
        last = job.steps == job.max_tokens
        scored = None
        if job.logprobs is not None:
            scored = _logprobs(self.engine.log_probs(logits), picks, job.logprobs, self.tokenizer)
        pieces = []
        for i, (choice, token) in enumerate(zip(job.choices, picks, strict=True)):
            if choice.stream.done:
                continue
            choice.tokens += 1
            if scored is not None:
                offset = len(job.echo or "") + len(choice.stream.text)
                choice.pending.append(TokenLogprob(*scored[i], offset=offset))
            if token == self.tokenizer.eot_id or token in job.stop_ids:
                choice.stream.close("end_of_text")
            else:
                choice.stream.feed(self.tokenizer.decode_bytes([token]))
                if last:
                    choice.stream.close("length")
            text = choice.stream.take()
            if text or choice.stream.done:
                pieces.append(Piece(job.first_index + i, text, choice.stream.finish_reason, choice.pending))
                choice.pending = []
        if pieces or job.done:
            self._outbox.append((job, Update(pieces, done=job.done)))

    def _retire(self, group: _Group) -> None:
        """Take finished and cancelled jobs out of the group, their rows out of its cache."""
        keep = [not (job.done or job.cancelled) for job in group.jobs]
        if all(keep):
            return
        with self._wake:
            self.active_rows -= sum(job.n for job, k in zip(group.jobs, keep, strict=True) if not k)
        _select(self.engine, group, keep)

    def _advance(self, group: _Group) -> list[_Group]:
        """Append the sampled tokens to the windows; a job's windows past block_size slide (decode's
        policy), and the job leaves the group to be read again: returned as a group of its own, unless it
        was the whole group (whose cache is then dropped)."""
        if not group.tokens or not group.jobs:
            return []
        for window, token in zip(group.windows, group.tokens, strict=True):
            window.append(token)
        group.tokens = []
        if self.engine.rotary:
            return []
        firsts = list(itertools.accumulate((job.n for job in group.jobs[:-1]), initial=0))  # jobs' first rows
        drops = [window_drop(len(group.windows[r]), self.engine.block_size, self.slide) for r in firsts]
        if not any(drops):
            return []
        moved = _Group([], [])
        for job, first, drop in zip(group.jobs, firsts, drops, strict=True):
            for window in group.windows[first : first + job.n] if drop else ():
                del window[:drop]
                moved.windows.append(window)
            moved.jobs += [job] if drop else []
        if all(drops):
            group.cache = None
            return []
        _select(self.engine, group, [not drop for drop in drops])
        return [moved]

    def _merge(self, groups: list[_Group]) -> list[_Group]:
        by_key: dict[tuple[bool, int], list[_Group]] = {}
        for group in groups:
            by_key.setdefault(group.key(), []).append(group)
        return [parts[0] if len(parts) == 1 else self._join(parts) for parts in by_key.values()]

    def _join(self, parts: list[_Group]) -> _Group:
        jobs = [job for g in parts for job in g.jobs]
        windows = [w for g in parts for w in g.windows]
        if parts[0].cache is None:
            return _Group(jobs, windows)
        return _Group(jobs, windows, self.engine.gather([(g.cache, 0, g.cache.batch) for g in parts]))

    def _forward(self, group: _Group) -> Any:
        self.forwards += 1
        self.rows_forwarded += len(group.windows)
        if group.cache is not None:
            return self.engine.forward([[w[-1]] for w in group.windows], group.cache)
        group.cache = self.engine.new_cache(len(group.windows))
        # a 1-row prefill fills every row of an empty cache: n samples of one prompt cost one row
        same = all(w == group.windows[0] for w in group.windows)
        return self.engine.forward(group.windows[:1] if same else group.windows, group.cache)

    def _fail_all(self, message: str) -> None:
        with self._wake:
            jobs = [job for g in self.groups for job in g.jobs] + list(self._waiting)
            self.groups, self.active_rows = [], 0
            self._waiting.clear()
        self._outbox = []
        self.deliver([(job, Update([], done=True, error=message)) for job in jobs])


def notify_each(updates: list[tuple[Job, Update]]) -> None:
    """Hand each update to its job's `notify` (the default `deliver`: on the decoding thread itself)."""
    for job, update in updates:
        job.notify(update)


def _select(engine: Engine, group: _Group, keep: list[bool]) -> None:
    """Keep the jobs of `group` that `keep` marks: their rows of its cache, windows and tokens."""
    rows = [k for job, k in zip(group.jobs, keep, strict=True) for _ in range(job.n)]
    if group.cache is not None and any(keep):
        group.cache = engine.gather([(group.cache, a, b) for a, b in _runs(rows)])
    group.jobs = [job for job, k in zip(group.jobs, keep, strict=True) if k]
    group.windows = [w for w, k in zip(group.windows, rows, strict=True) if k]
    group.tokens = [t for t, k in zip(group.tokens, rows, strict=True) if k] if group.tokens else []


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """The (start, stop) ranges of consecutive True entries."""
    runs: list[tuple[int, int]] = []
    for i, keep in enumerate(mask):
        if keep and runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        elif keep:
            runs.append((i, i + 1))
    return runs


def _logprobs(
    logp: np.ndarray, picks: list[int], top: int, tokenizer: Tokenizer
) -> list[tuple[str, float, dict[str, float]]]:
    """Each row's picked token, its log-probability under the model (`logp`: the engine's log_probs of the
    logits, before temperature, top-k and top-p) and the `top` most likely tokens with theirs."""
    out = []
    for row, token in zip(logp, picks, strict=True):
        best = np.argsort(-row, kind="stable")[:top]
        out.append(
            (_text(tokenizer, token), float(row[token]), {_text(tokenizer, i): float(row[i]) for i in best})
        )
    return out


def _prompt_logprobs(logp: np.ndarray, ids: list[int], top: int, tokenizer: Tokenizer) -> list[TokenLogprob]:
    """Each prompt token's entry: the first has no log-probability, each later one its log-probability after
    the tokens before it (`logp[i]` is the distribution of `ids[i + 1]`); offsets are where each token's
    text starts."""
    scored = _logprobs(logp, ids[1:], top, tokenizer)
    data = b""
    offsets = []
    for token in ids:
        offsets.append(len(data.decode("utf-8", errors="ignore")))
        data += tokenizer.decode_bytes([token])
    first = TokenLogprob(_text(tokenizer, ids[0]), None, None, 0)
    return [first, *(TokenLogprob(*entry, offset=o) for entry, o in zip(scored, offsets[1:], strict=True))]


def _text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode_bytes([int(token)]).decode("utf-8", errors="backslashreplace")
