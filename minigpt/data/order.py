"""The order training reads a split's windows in: epochs, each a keyed shuffle of the split's windows.

An epoch takes the windows that start at offset, offset + block_size, offset + 2 block_size, ... (no two
overlap, together they cover the split) in a shuffled order, the offset and the order drawn from the
run's seed and the epoch's number. Every window of the text is read once an epoch, where windows drawn
at random with replacement read some parts of a small corpus several times before others once; the
offset moves the windows' edges from one epoch to the next.

The shuffle is a keyed permutation computed index by index (`Shuffle`), never a list of the windows: a
10 GB corpus holds tens of millions of windows, and a sampler's state stays the count of windows read.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["EpochOrder", "Shuffle"]

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROUNDS = 4  # Feistel rounds: four make a pseudo-random permutation of a keyed round function


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of each uint64 of z: every input bit flips about half of the output bits."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key(*parts: object) -> int:
    """A 64-bit key from the parts' text."""
    text = ":".join(str(p) for p in ("minigpt-epochs", *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class Shuffle:
    """A keyed pseudo-random permutation of range(n), any index's image in constant time and memory: a
    Feistel network over the smallest domain of 4^h >= n values (two halves of h bits), walked along its
    cycle until it lands inside range(n) (cycle-walking: the walk from an index inside returns inside,
    so the result is a permutation of range(n); the domain is under 4n, so a walk takes under 4 steps on
    average)."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a shuffle needs at least one item, not {n}")
        self.n = n
        self.half = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = _mix(np.arange(_ROUNDS, dtype=np.uint64) + np.uint64(key))

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of `indices` (each in range(n)) as int64."""
        x = np.asarray(indices, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index outside the shuffle of {self.n}")
        with np.errstate(over="ignore"):
            x = self._round_trip(x)
            outside = x >= np.uint64(self.n)
            while outside.any():
                x[outside] = self._round_trip(x[outside])
                outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class EpochOrder:
    """Window starts in [0, high) for window numbers 0, 1, 2, ... of a run: number w is item w % n of epoch
    w // n, n = the windows of stride `stride` that fit (at least one)."""

    def __init__(self, high: int, stride: int, seed: int) -> None:
        self.high, self.stride, self.seed = high, stride, seed
        self.per_epoch = max(1, high // stride)
        # the last window of an epoch starts at offset + (per_epoch - 1) * stride, before high
        self.offsets = high - (self.per_epoch - 1) * stride
        self._epochs: dict[int, tuple[int, Shuffle]] = {}

    def _epoch(self, epoch: int) -> tuple[int, Shuffle]:
        if epoch not in self._epochs:
            if len(self._epochs) > 2:  # a batch spans at most two epochs: keep the current ones
                self._epochs.clear()
            key = _key(self.seed, self.high, self.stride, epoch)
            self._epochs[epoch] = (key % self.offsets, Shuffle(self.per_epoch, key))
        return self._epochs[epoch]

    def starts(self, first: int, count: int) -> list[int]:
        """The starts of windows first .. first + count - 1."""
        numbers = np.arange(first, first + count, dtype=np.int64)
        epochs, items = np.divmod(numbers, self.per_epoch)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            offset, shuffle = self._epoch(epoch)
            chosen = epochs == epoch
            out[chosen] = offset + shuffle(items[chosen]) * self.stride
        return out.tolist()
