"""Scoring prompts: each prompt token's log-probabilities given the tokens before it, for `echo` with
`logprobs` (what lm-evaluation-harness's loglikelihood tasks ask for).

Prompts of one length are scored together, in one prefill that returns the logits of every position
(`Engine.forward(..., every_position=True)`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minigpt.generate.decode import Engine

__all__ = ["prompt_log_probs"]


def prompt_log_probs(engine: Engine, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, T - 1, vocab) float64 log-probabilities for B prompts of one length T (at most the engine's
    block_size): [b, i] is the model's distribution after prompts[b][: i + 1], that of prompts[b][i + 1]."""
    length = len(prompts[0])
    if any(len(p) != length for p in prompts) or length > engine.block_size:
        raise ValueError("prompt_log_probs takes prompts of one length, at most block_size tokens")
    # no cache: nothing is decoded after it, and a float16 cache would round what the prompt's scores read
    logits = engine.forward(prompts, None, every_position=True)
    return engine.log_probs(logits)[:, :-1]
