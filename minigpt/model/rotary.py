"""Rotary positions (Su et al. 2021), in place of GPT-2's learned position embeddings (no I/O).

Nothing is added to the token embeddings: every block turns its queries and keys by angles that grow with
their position, so that a query-key score depends on how far apart the two stand, not on where. The default
path computes the angles once per forward pass (`angles`, from `gpt.embed`) and each layer turns its queries
and keys by them (`rotate`, from `variants.qkv_variants`).
"""

from __future__ import annotations

import numpy as np
import torch

from minigpt.model.kv_cached import row_positions

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos and sin of every position's angles, (T, head_dim)


def angles(base: float, head_dim: int, start: int | np.ndarray, length: int, device: torch.device) -> Rotary:
    """The angles of `length` new tokens from `start` (`kvcache.first_position`'s answer): (length, head_dim)
    for rows that share their positions, (B, 1, 1, head_dim) for rows at different positions (one token
    each), either way broadcasting against queries and keys (B, H, T, head_dim)."""
    if isinstance(start, int):
        return rotary(base, head_dim, start, length, device)
    cos, sin = rotary_at(base, head_dim, row_positions(start, length, device))
    return cos[:, None], sin[:, None]


def rotary(base: float, head_dim: int, start: int, length: int, device: torch.device) -> Rotary:
    """cos and sin (length, head_dim) of the rotary angles of positions start..start+length.

    Dimension i and i + head_dim/2 turn together at frequency base^(-2i/head_dim), the pairing (and
    float32 arithmetic) of Hugging Face's Llama, so converted weights need no permutation.
    """
    return rotary_at(base, head_dim, torch.arange(start, start + length, device=device, dtype=torch.int64))


def rotary_at(base: float, head_dim: int, positions: torch.Tensor) -> Rotary:
    """`rotary` at any positions (an integer tensor): cos and sin of shape positions.shape + (head_dim,)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    turns = positions.float()[..., None] * (1.0 / base**exponents)
    turns = torch.cat((turns, turns), dim=-1)
    return turns.cos(), turns.sin()


def rotate(x: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """x (B, H, T, hd) turned by its positions' angles: q·k then depends only on their distance."""
    cos, sin = (t.to(x.dtype) for t in rope)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
