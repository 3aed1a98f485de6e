"""Tokenizers behind one interface: characters, trained byte-level BPE, and tiktoken encodings."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from minigpt.errors import MinigptError


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


class CharTokenizer(Tokenizer):
    """One id per distinct character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        if not chars:
            raise MinigptError("a char tokenizer needs at least one character")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if len(self.stoi) != len(self.chars):
            raise MinigptError("char tokenizer characters must be distinct")

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            missing = sorted({c for c in text if c not in self.stoi})
            shown = ", ".join(repr(c) for c in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            raise MinigptError(
                f"text has {len(missing)} character(s) the char tokenizer never saw in training: "
                f"{shown}{more}; remove them or train with --tokenizer bpe"
            ) from None

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}


def tokenizer_from_json(data: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from what `Tokenizer.to_json` wrote."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "char":
        chars = data.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise MinigptError("tokenizer.json: a char tokenizer needs a list of single characters")
        return CharTokenizer(chars)
    raise MinigptError(f"tokenizer.json: unknown tokenizer kind {kind!r}")
