"""The char tokenizer: one id per distinct character of the training text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from minigpt.errors import MinigptError
from minigpt.tokenizer.base import ENDOFTEXT, MAX_UNUSED_IDS, Tokenizer, is_id, shorten

if TYPE_CHECKING:
    import numpy as np


class CharTokenizer(Tokenizer):
    """One id per distinct character of the training text (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: Sequence[str], specials: dict[str, int] | None = None) -> None:
        self.chars = list(chars)
        _check_chars(self.chars)
        self._specials = dict(specials or {})
        _check_char_specials(self._specials, len(self.chars))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # id -> text of every id: the characters, then the control tokens (None: an unused id)
        self._itos: list[str | None] = [*self.chars, *[None] * (self.vocab_size - len(self.chars))]
        for name, i in self._specials.items():
            self._itos[i] = name
        self._lookup: np.ndarray | None = None

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The characters of all the texts (streamed, so the whole corpus need not fit in memory)."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars:
            raise MinigptError("no text to build the char tokenizer from: the training text is empty")
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return max([len(self.chars), *(i + 1 for i in self._specials.values())])

    @property
    def specials(self) -> dict[str, int]:
        return dict(self._specials)

    @property
    def eot_id(self) -> int | None:
        return self._specials.get(ENDOFTEXT)

    def with_specials(self, names: Sequence[str], first_id: int) -> CharTokenizer:
        return CharTokenizer(self.chars, self._added_specials(names, first_id))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            raise MinigptError(self.unknown_message(self.unknown_chars(text))) from None

    @staticmethod
    def unknown_message(missing: Iterable[str], where: str = "text") -> str:
        missing = sorted(missing)
        shown = ", ".join(repr(c) for c in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        return (
            f"{where} has {len(missing)} character(s) the char tokenizer never saw in training: "
            f"{shown}{more}; remove them or train with --tokenizer bpe"
        )

    def _codepoints(self, text: str) -> np.ndarray:
        import numpy as np

        return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)

    def _table(self) -> np.ndarray:
        """Code point -> id (-1: unknown); the last slot stands for every code point past the largest."""
        import numpy as np

        if self._lookup is None:
            cps = [ord(c) for c in self.chars]
            table = np.full(max(cps) + 2, -1, dtype=np.int32)
            table[cps] = np.arange(len(cps), dtype=np.int32)
            self._lookup = table
        return self._lookup

    def lookup(self, text: str) -> np.ndarray:
        """int32 ids of the characters of text, -1 for a character with no id."""
        import numpy as np

        table = self._table()
        return table[np.minimum(self._codepoints(text), len(table) - 1)]

    def unknown_chars(self, text: str) -> set[str]:
        """The characters of text that have no id."""
        import numpy as np

        cps = self._codepoints(text)
        unknown = self.lookup(text) < 0
        if not unknown.any():
            return set()
        return {chr(int(c)) for c in np.unique(cps[unknown])}

    def encode_arrays(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
        import numpy as np

        out = []
        for text in texts:
            ids = self.lookup(text)
            if (ids < 0).any():
                raise MinigptError(self.unknown_message(self.unknown_chars(text)))
            out.append(ids.astype(np.uint32))
        return out

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        try:
            text = "".join(self._itos[i] for i in ids)  # type: ignore[misc]  # None raises TypeError
        except (IndexError, TypeError):
            text = None
        if text is None:
            raise MinigptError(f"token ids must be 0..{self.vocab_size - 1} for this char tokenizer")
        return text

    def text_byte_lengths(self) -> np.ndarray:
        import numpy as np

        lengths = np.zeros(self.vocab_size, dtype=np.int64)  # control tokens and unused ids: 0
        lengths[: len(self.chars)] = [len(c.encode("utf-8")) for c in self.chars]
        return lengths

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "chars": self.chars}
        if self._specials:
            data["specials"] = self.specials
        return data

    def describe(self) -> str:
        return f"char ({self.vocab_size:,} symbols)"


def _check_chars(chars: list[Any]) -> None:
    """Distinct single code points that UTF-8 can encode, so every id decodes to text."""
    if not chars:
        raise MinigptError("a char tokenizer needs at least one character")
    bad = next((c for c in chars if not (isinstance(c, str) and len(c) == 1)), None)
    if bad is not None:
        raise MinigptError(f"char tokenizer symbols must be single characters, not {shorten(bad)}")
    surrogate = next((c for c in chars if 0xD800 <= ord(c) <= 0xDFFF), None)
    if surrogate is not None:
        raise MinigptError(
            f"char tokenizer symbol {surrogate!r} is a lone surrogate (U+{ord(surrogate):04X}), "
            f"which is not text: no UTF-8 file holds it"
        )
    if len(set(chars)) != len(chars):
        raise MinigptError("char tokenizer characters must be distinct")


def _check_char_specials(specials: dict[str, int], n_chars: int) -> None:
    """Control tokens of a char tokenizer: names of several characters (a one-character name would read
    as that character), distinct ids after the characters', at most MAX_UNUSED_IDS of them unused."""
    if not all(isinstance(s, str) and len(s) > 1 for s in specials):
        raise MinigptError("char tokenizer control tokens must be names of two or more characters")
    ids = list(specials.values())
    if not all(is_id(i) and i >= n_chars for i in ids) or len(set(ids)) != len(ids):
        raise MinigptError(
            f"char tokenizer control token ids must be distinct integers from {n_chars} (after the characters)"
        )
    if ids and max(ids) + 1 - n_chars - len(ids) > MAX_UNUSED_IDS:
        raise MinigptError(f"char tokenizer control token ids leave more than {MAX_UNUSED_IDS:,} ids unused")
