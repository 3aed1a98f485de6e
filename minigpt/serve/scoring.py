"""Scoring prompts: the logits the model gives after every prompt position, for `echo` with `logprobs`
(each prompt token's log-probability given the ones before it, as lm-evaluation-harness asks for).

One function, so that an engine call returning every position's logits from one prefill can replace the
loop: today it feeds the prompts through the engine's KV cache one position at a time, all rows together,
which the decode loop's own parity tests hold equal to a full forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minigpt.decode import Engine

__all__ = ["prompt_logits"]


def _numpy(logits: object) -> np.ndarray:
    """An engine's logits (a NumPy array or a torch tensor) as float64 NumPy."""
    if hasattr(logits, "cpu"):
        logits = logits.float().cpu().numpy()  # type: ignore[attr-defined]
    return np.asarray(logits, dtype=np.float64)


def prompt_logits(engine: Engine, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, T - 1, vocab) float64 logits for B prompts of one length T (at most the engine's block_size):
    [b, i] is what the model predicts after prompts[b][: i + 1], the distribution of prompts[b][i + 1]."""
    length = len(prompts[0])
    if any(len(p) != length for p in prompts) or length > engine.block_size:
        raise ValueError("prompt_logits takes prompts of one length, at most block_size tokens")
    cache = engine.new_cache(len(prompts))
    rows = [_numpy(engine.forward([[p[i]] for p in prompts], cache)) for i in range(length - 1)]
    vocab = rows[0].shape[-1] if rows else 0
    return np.stack(rows, axis=1) if rows else np.zeros((len(prompts), 0, vocab))
