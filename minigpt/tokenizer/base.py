"""The tokenizer interface every kind implements, and the helpers their checks share."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.errors import MinigptError

if TYPE_CHECKING:
    import numpy as np


ENDOFTEXT = "<|endoftext|>"

MAX_VOCAB_SIZE = 1 << 21  # 8x o200k's vocabulary: ids past it are damage and would allocate without bound
MAX_UNUSED_IDS = 1024  # ids below the largest that nothing uses (cl100k and o200k leave about 20)


def default_threads() -> int:
    """Threads for batch encoding: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def shorten(value: Any, limit: int = 40) -> str:
    """repr of an untrusted value cut to `limit` characters: one short line whatever a file holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def naming(source: str | Path, fix: str) -> Iterator[None]:
    """Prefix a MinigptError raised inside with the file it is about and append the fix."""
    try:
        yield
    except MinigptError as e:
        raise MinigptError(f"{source}: {e}; {fix}", e.exit_code) from None


class Tokenizer(ABC):
    """Text <-> token ids. Serialises to a small JSON dict that travels inside a checkpoint."""

    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids (the model's vocab_size), specials included."""

    @property
    def eot_id(self) -> int | None:
        """Id of <|endoftext|>, or None where the kind has no such token."""
        return None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of text; special-token strings in text are encoded as plain text."""

    @abstractmethod
    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes the ids stand for (may end inside a multi-byte character)."""

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer, as JSON-safe data with a "kind" key."""

    def describe(self) -> str:
        """A short human label such as 'char (65 symbols)'."""
        return f"{self.kind} ({self.vocab_size:,} tokens)"

    def digest(self) -> str:
        """sha256 of everything that decides the ids (what the token store is keyed by); computed once."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            cached = self.__dict__["_digest"] = self._content_hash()
        return cached

    def _content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """`encode` of each text; kinds backed by native code spread the texts over threads."""
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
        """Like `encode_batch` but each result is a uint32 numpy array (no Python int per token)."""
        import numpy as np

        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode_batch(texts, num_threads)]

    def text_byte_lengths(self) -> np.ndarray:
        """UTF-8 length of the text each id stands for (int64, one per id; special tokens count 0).

        Summing it over ids gives the byte count of a text from its tokens, for bits-per-byte.
        """
        import numpy as np

        specials = set(self.special_ids())
        return np.array(
            [0 if i in specials else len(self.decode_bytes([i])) for i in range(self.vocab_size)],
            dtype=np.int64,
        )

    def special_ids(self) -> list[int]:
        """Ids that are control tokens rather than text."""
        return sorted(self.specials.values())

    @property
    def specials(self) -> dict[str, int]:
        """Control tokens by name (never produced by `encode`, which reads their names as plain text)."""
        return {} if self.eot_id is None else {ENDOFTEXT: self.eot_id}

    def with_specials(self, names: Sequence[str], first_id: int) -> Tokenizer:
        """This tokenizer plus the control tokens `names` it lacks, numbered from `first_id` (at least
        vocab_size: ids past a model's rows are new rows, never ids it already uses)."""
        raise MinigptError(f"a {self.kind} tokenizer cannot take new control tokens")

    def _added_specials(self, names: Sequence[str], first_id: int) -> dict[str, int]:
        if first_id < self.vocab_size:
            raise MinigptError(f"new token ids must start at {self.vocab_size} or later, not {first_id}")
        missing = [n for n in dict.fromkeys(names) if n not in self.specials]
        return {**self.specials, **{name: first_id + i for i, name in enumerate(missing)}}


def is_id(i: Any) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_VOCAB_SIZE
