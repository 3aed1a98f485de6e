"""Answers to tasks' prompts, sampled through the one decode loop (minigpt.generate.decode) with its KV cache.

Prompts of one length are decoded together, each repeated for its samples, at most `rows` rows at a time
(the decode loop batches prompts of one length); every row stops at the chat template's control tokens or
after `max_tokens`. A batch's random draws come from a seed per decode call, made from the caller's seed
and the call's first prompt, so the same prompts, seed and weights give the same answers (a resumed run
draws what the uninterrupted one drew).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from minigpt.generate.decode import Engine, Sampling, decode
from minigpt.tokenizer.base import Tokenizer

# rows one decode call takes at most: its KV cache holds them all
MAX_ROWS = 256


@dataclass(frozen=True)
class Answer:
    """One sampled answer: its tokens (the control token that ended it included, if one did) and text."""

    ids: list[int]
    text: str
    stopped: bool  # ended by a control token, not by the token limit


def call_seed(seed: int, first: int) -> int:
    """The seed of a decode call whose first prompt is number `first` of the caller's prompts."""
    text = f"minigpt-answers:{seed}:{first}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def answer(
    engine: Engine,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    samples: int,
    max_tokens: int,
    stop_ids: Collection[int],
    sampling: Sampling,
    rows: int = MAX_ROWS,
) -> list[list[Answer]]:
    """`samples` answers to each prompt (greedy ones at temperature 0), in the prompts' order."""
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(i)
    out: list[list[Answer]] = [[] for _ in prompts]
    per_call = max(1, rows // samples)
    for members in groups.values():
        for start in range(0, len(members), per_call):
            chunk = members[start : start + per_call]
            calls = [list(prompts[i]) for i in chunk for _ in range(samples)]
            seeded = replace(sampling, seed=call_seed(sampling.seed, chunk[0]))
            tokens = _decoded(engine, calls, max_tokens, frozenset(stop_ids), seeded)
            for n, i in enumerate(chunk):
                out[i] = [
                    _answer(tokenizer, ids, stop_ids) for ids in tokens[n * samples : (n + 1) * samples]
                ]
    return out


def _decoded(
    engine: Engine, prompts: list[list[int]], max_tokens: int, stop_ids: frozenset[int], sampling: Sampling
) -> list[list[int]]:
    """Each row's tokens up to and including the first of `stop_ids`, at most max_tokens; decoding ends
    when every row has stopped."""
    rows: list[list[int]] = [[] for _ in prompts]
    live = set(range(len(prompts)))
    steps = decode(engine, prompts, max_tokens, sampling=sampling)
    for tokens in steps:
        for i in sorted(live):
            rows[i].append(tokens[i])
            if tokens[i] in stop_ids:
                live.discard(i)
        if not live:
            break
    steps.close()
    return rows


def _answer(tokenizer: Tokenizer, ids: list[int], stop_ids: Collection[int]) -> Answer:
    stopped = bool(ids) and ids[-1] in stop_ids
    return Answer(ids, tokenizer.decode(ids[:-1] if stopped else ids), stopped)
