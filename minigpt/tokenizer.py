"""Tokenizers behind one interface: characters, trained byte-level BPE, and tiktoken encodings."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.dataconfig import DEFAULT_BPE_VOCAB_SIZE
from minigpt.errors import MinigptError, UsageError
from minigpt.files import read_bounded, read_json

if TYPE_CHECKING:
    import numpy as np
    import tiktoken

ENDOFTEXT = "<|endoftext|>"

# GPT-2's split pattern as tiktoken writes it (r50k_base, p50k_base, gpt2)
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# cl100k_base (GPT-4) exactly as tiktoken ships it
CL100K_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
# The same splits as CL100K_SPLIT_PATTERN (tests check this on random text) without the possessive
# quantifiers that cannot change a match there, which tiktoken's regex engine runs faster (README: "Tokenizers").
GPT4_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s++$|\s*[\r\n]|\s+(?!\S)|\s+"""
O200K_SPLIT_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# A tokenizer file names one of these rather than bringing its own regex: an arbitrary pattern can
# backtrack for minutes per text or panic tiktoken's regex engine, and checking one under a time bound
# would still miss inputs the probe did not try.
KNOWN_SPLIT_PATTERNS = {
    GPT2_SPLIT_PATTERN: "GPT-2",
    CL100K_SPLIT_PATTERN: "cl100k",
    GPT4_SPLIT_PATTERN: "GPT-4 (minigpt's bpe)",
    O200K_SPLIT_PATTERN: "o200k",
}
MAX_VOCAB_SIZE = 1 << 21  # 8x o200k's vocabulary: ids past it are damage and would allocate without bound
MAX_UNUSED_IDS = 1024  # ids below the largest that nothing uses (cl100k and o200k leave about 20)

_BLOB = "https://openaipublic.blob.core.windows.net/encodings/"


@dataclass(frozen=True)
class NamedEncoding:
    """Where tiktoken downloads a public encoding from, and what it builds from the ranks file."""

    name: str
    file: str  # the ranks file; tiktoken caches it as sha1(url) in $TIKTOKEN_CACHE_DIR
    sha256: str
    pattern: str
    specials: dict[str, int]

    @property
    def url(self) -> str:
        return _BLOB + self.file


# Values from tiktoken_ext.openai_public (tests compare against it). gpt2 is r50k_base: the same ranks,
# pattern and <|endoftext|>; tiktoken merely builds it from GPT-2's original vocab.bpe/encoder.json.
_R50K = NamedEncoding(
    "r50k_base",
    "r50k_base.tiktoken",
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    GPT2_SPLIT_PATTERN,
    {ENDOFTEXT: 50256},
)
NAMED_ENCODINGS: dict[str, NamedEncoding] = {
    "gpt2": NamedEncoding("gpt2", _R50K.file, _R50K.sha256, _R50K.pattern, _R50K.specials),
    "r50k_base": _R50K,
    "p50k_base": NamedEncoding(
        "p50k_base",
        "p50k_base.tiktoken",
        "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069",
        GPT2_SPLIT_PATTERN,
        {ENDOFTEXT: 50256},
    ),
    "cl100k_base": NamedEncoding(
        "cl100k_base",
        "cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        CL100K_SPLIT_PATTERN,
        {
            ENDOFTEXT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "o200k_base": NamedEncoding(
        "o200k_base",
        "o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        O200K_SPLIT_PATTERN,
        {ENDOFTEXT: 199999, "<|endofprompt|>": 200018},
    ),
}

TOKENIZER_CHOICES = (
    "char, bpe, " + ", ".join(NAMED_ENCODINGS) + ", a path to a .tiktoken file or a minigpt tokenizer.json"
)


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
    if not all(_is_id(i) and i >= n_chars for i in ids) or len(set(ids)) != len(ids):
        raise MinigptError(
            f"char tokenizer control token ids must be distinct integers from {n_chars} (after the characters)"
        )
    if ids and max(ids) + 1 - n_chars - len(ids) > MAX_UNUSED_IDS:
        raise MinigptError(f"char tokenizer control token ids leave more than {MAX_UNUSED_IDS:,} ids unused")


class _RankedBPE(Tokenizer):
    """A byte-level BPE given by mergeable ranks, a split pattern and special tokens, run by tiktoken."""

    def __init__(self, name: str, pattern: str, ranks: dict[bytes, int], specials: dict[str, int]) -> None:
        check_split_pattern(pattern)
        _check_ids(ranks, specials)
        self.name = name
        self.pattern = pattern
        self.ranks = ranks
        self._specials = dict(specials)
        import tiktoken

        self._enc = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=self._specials
        )

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying tiktoken Encoding."""
        return self._enc

    @property
    def vocab_size(self) -> int:
        return self._enc.max_token_value + 1

    @property
    def eot_id(self) -> int | None:
        return self._specials.get(ENDOFTEXT)

    @property
    def specials(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return self._map(self._enc.encode_ordinary, texts, num_threads)

    def encode_arrays(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
        # encode_to_numpy skips building a Python int per token; with no specials allowed and none
        # disallowed, special-token strings in the text are encoded as plain text like encode_ordinary
        def one(text: str) -> np.ndarray:
            return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

        return self._map(one, texts, num_threads)

    @staticmethod
    def _map(fn: Callable[[str], Any], texts: Sequence[str], num_threads: int | None) -> list[Any]:
        threads = min(num_threads or default_threads(), len(texts))
        if threads <= 1:
            return [fn(t) for t in texts]
        # tiktoken releases the GIL while encoding, so threads run in parallel
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(fn, texts))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return self._enc.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError, ValueError):
            bad = next((i for i in ids if not self._is_token(i)), None)
            raise MinigptError(f"token id {bad} is not in the {self.describe()} vocabulary") from None

    def _is_token(self, i: Any) -> bool:
        try:
            self._enc.decode_single_token_bytes(int(i))
            return True
        except (KeyError, OverflowError, TypeError, ValueError):
            return False

    def text_byte_lengths(self) -> np.ndarray:
        import numpy as np

        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, rank in self.ranks.items():
            lengths[rank] = len(token)
        return lengths

    def _content_hash(self) -> str:
        # straight from the ranks: to_json's base64 of a 50k-200k vocabulary takes a second
        h = hashlib.sha256(json.dumps([self.kind, self.pattern, self.specials], sort_keys=True).encode())
        for token, rank in sorted(self.ranks.items(), key=lambda item: item[1]):
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token)
        return h.hexdigest()

    def to_json(self) -> dict[str, Any]:
        # ranks as base64 token bytes in rank order (null for an unused rank): ~12 bytes per token
        table: list[str | None] = [None] * (max(self.ranks.values()) + 1)
        for token, rank in self.ranks.items():
            table[rank] = base64.b64encode(token).decode("ascii")
        return {
            "kind": self.kind,
            "name": self.name,
            "pattern": self.pattern,
            "specials": self.specials,
            "ranks": table,
        }

    @staticmethod
    def _parse_json(data: dict[str, Any]) -> tuple[str, str, dict[bytes, int], dict[str, int]]:
        name, pattern, table, specials = (data.get(k) for k in ("name", "pattern", "ranks", "specials"))
        types_ok = isinstance(name, str) and isinstance(pattern, str) and isinstance(specials, dict)
        if not (types_ok and isinstance(table, list)):
            raise MinigptError(f"a {data.get('kind')} tokenizer needs name, pattern, ranks and specials")
        if len(table) > MAX_VOCAB_SIZE:
            raise MinigptError(
                f"{len(table):,} ranks are more than a tokenizer may have ({MAX_VOCAB_SIZE:,})"
            )
        ranks: dict[bytes, int] = {}
        try:
            for rank, token in enumerate(table):
                if token is not None:
                    _add_rank(ranks, base64.b64decode(token, validate=True), rank)
        except (binascii.Error, TypeError, ValueError):
            raise MinigptError(f"rank {rank} is not base64 token bytes") from None
        return name, pattern, ranks, specials


def check_split_pattern(pattern: Any) -> None:
    """Raise a MinigptError unless pattern is one of KNOWN_SPLIT_PATTERNS."""
    if not (isinstance(pattern, str) and pattern in KNOWN_SPLIT_PATTERNS):
        known = ", ".join(KNOWN_SPLIT_PATTERNS.values())
        raise MinigptError(
            f"split pattern {shorten(pattern)} is not one minigpt knows ({known}): "
            f"a tokenizer file cannot bring its own regex"
        )


def _add_rank(ranks: dict[bytes, int], token: bytes, rank: int) -> None:
    if token in ranks:
        raise MinigptError(f"token {token[:20]!r} has two ranks, {ranks[token]} and {rank}")
    ranks[token] = rank


def _is_id(i: Any) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_VOCAB_SIZE


def _check_ids(ranks: dict[bytes, int], specials: dict[str, int]) -> None:
    """Ids tiktoken can hold and a model can embed: distinct, in range, dense, all 256 byte tokens."""
    if not all(isinstance(t, bytes) and t for t in ranks):
        raise MinigptError("ranked tokens must be non-empty byte strings")
    if not all(isinstance(s, str) and s for s in specials):
        raise MinigptError("special token names must be non-empty strings")
    ids = [*ranks.values(), *specials.values()]
    bad = [i for i in ids if not _is_id(i)]
    if bad:
        raise MinigptError(f"token id {shorten(bad[0])} is not an integer in 0..{MAX_VOCAB_SIZE - 1:,}")
    if len(set(ids)) != len(ids):
        raise MinigptError("token ids must be distinct, special tokens' included")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # tiktoken would panic on text containing such a byte; a byte-level BPE has all 256
        raise MinigptError(
            f"lacks single-byte token(s) for {len(missing)} byte value(s) (e.g. {missing[0]}): "
            f"not a byte-level BPE"
        )
    unused = max(ids) + 1 - len(ids)
    if unused > MAX_UNUSED_IDS:
        raise MinigptError(
            f"ids run to {max(ids):,} but only {len(ids):,} tokens exist: {unused:,} unused ids "
            f"(at most {MAX_UNUSED_IDS:,})"
        )


class BPETokenizer(_RankedBPE):
    """A byte-level BPE trained on the user's text with rustbpe (GPT-4 split pattern), plus <|endoftext|>."""

    kind = "bpe"

    def __init__(
        self,
        ranks: dict[bytes, int],
        pattern: str = GPT4_SPLIT_PATTERN,
        specials: dict[str, int] | None = None,
        name: str = "bpe",
    ) -> None:
        super().__init__(name, pattern, ranks, {ENDOFTEXT: len(ranks)} if specials is None else specials)

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB_SIZE, pattern: str = GPT4_SPLIT_PATTERN
    ) -> BPETokenizer:
        """Learn merges from texts (streamed in chunks) until vocab_size ids, <|endoftext|> included.

        A small text may run out of pairs to merge first; the vocabulary is then smaller.
        """
        check_bpe_vocab_size(vocab_size)
        check_split_pattern(pattern)
        import rustbpe

        seen = False

        def chunks() -> Iterable[str]:
            nonlocal seen
            for text in texts:
                if text:
                    seen = True
                    yield text

        trainer = rustbpe.Tokenizer()
        # buffer_size counts strings held at once on the Rust side: keep it small since chunks are large
        trainer.train_from_iterator(iter(chunks()), vocab_size - 1, buffer_size=64, pattern=pattern)
        if not seen:
            raise MinigptError("no text to train the bpe tokenizer on: the training text is empty")
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        return cls(ranks, pattern)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BPETokenizer:
        name, pattern, ranks, specials = cls._parse_json(data)
        return cls(ranks, pattern, specials, name)

    def with_specials(self, names: Sequence[str], first_id: int) -> BPETokenizer:
        return BPETokenizer(self.ranks, self.pattern, self._added_specials(names, first_id), self.name)


def check_bpe_vocab_size(vocab_size: Any) -> None:
    """Raise a UsageError unless vocab_size can hold the 256 byte tokens plus <|endoftext|>."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise UsageError(
            f"--vocab-size {vocab_size} is too small for --tokenizer bpe: it needs at least 257 "
            f"(256 byte tokens + <|endoftext|>); {DEFAULT_BPE_VOCAB_SIZE} is a good start for small models"
        )


class TiktokenTokenizer(_RankedBPE):
    """One of tiktoken's public encodings, or any .tiktoken ranks file, loaded without the network."""

    kind = "tiktoken"

    def __init__(self, name: str, pattern: str, ranks: dict[bytes, int], specials: dict[str, int]) -> None:
        super().__init__(name, pattern, ranks, specials)

    @classmethod
    def from_name(cls, name: str) -> TiktokenTokenizer:
        """A named encoding from $TIKTOKEN_CACHE_DIR (or tiktoken's default cache); never downloads."""
        if name not in NAMED_ENCODINGS:
            raise UsageError(f"unknown tiktoken encoding {name!r}; choose from {', '.join(NAMED_ENCODINGS)}")
        spec = NAMED_ENCODINGS[name]
        looked: list[str] = []
        for path in _cache_candidates(spec):
            looked.append(str(path))
            if not path.is_file():
                continue
            data = read_bounded(path)
            if hashlib.sha256(data).hexdigest() != spec.sha256:
                continue  # a stale or partial download: tiktoken would fetch it again
            return cls(spec.name, spec.pattern, _parse_tiktoken_ranks(data), spec.specials)
        where = (
            ", ".join(dict.fromkeys(str(Path(p).parent) for p in looked))
            or "nowhere: TIKTOKEN_CACHE_DIR is empty"
        )
        raise MinigptError(
            f"tiktoken encoding {name} is not available offline (looked in {where}): download {spec.url} and "
            f"set TIKTOKEN_CACHE_DIR to its folder, or pass --tokenizer path/to/{spec.file}, "
            f"or use --tokenizer bpe or char"
        )

    @classmethod
    def from_file(cls, path: str | Path, pattern: str | None = None) -> TiktokenTokenizer:
        """Ranks from a .tiktoken file. The published files keep their own pattern and specials; any
        other file gets GPT-2's split pattern (unless `pattern` is given) and <|endoftext|> after the ranks.
        """
        path = Path(path)
        if not path.exists():
            raise MinigptError(f"{path}: no such .tiktoken file; choose from {TOKENIZER_CHOICES}")
        data = read_bounded(path)
        with naming(path, "pass a .tiktoken ranks file"):
            ranks = _parse_tiktoken_ranks(data)
            digest = hashlib.sha256(data).hexdigest()
            known = next(
                (e for e in NAMED_ENCODINGS.values() if e.sha256 == digest and e.name != "gpt2"), None
            )
            if known is not None:
                return cls(known.name, pattern or known.pattern, ranks, known.specials)
            return cls(path.stem, pattern or GPT2_SPLIT_PATTERN, ranks, {ENDOFTEXT: max(ranks.values()) + 1})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TiktokenTokenizer:
        return cls(*cls._parse_json(data))

    def with_specials(self, names: Sequence[str], first_id: int) -> TiktokenTokenizer:
        return TiktokenTokenizer(self.name, self.pattern, self.ranks, self._added_specials(names, first_id))

    def describe(self) -> str:
        return f"tiktoken {self.name} ({self.vocab_size:,} tokens)"


def _cache_candidates(spec: NamedEncoding) -> list[Path]:
    """Files that may hold the ranks: tiktoken's own cache name (sha1 of the url) and `<name>.tiktoken`."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        dirs = [os.environ["TIKTOKEN_CACHE_DIR"]]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        dirs = [os.environ["DATA_GYM_CACHE_DIR"]]
    else:
        dirs = [os.path.join(tempfile.gettempdir(), "data-gym-cache")]
    key = hashlib.sha1(spec.url.encode()).hexdigest()
    names = dict.fromkeys([key, spec.file, f"{spec.name}.tiktoken"])
    return [Path(d) / n for d in dirs if d for n in names]


def _parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    # our own reader: tiktoken.load would also copy a local file into its cache directory
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            b64, number = line.split()
            token, rank = base64.b64decode(b64, validate=True), int(number)
        except (ValueError, binascii.Error):
            raise MinigptError(f"line {lineno} is not 'base64-token rank'") from None
        _add_rank(ranks, token, rank)
        if len(ranks) > MAX_VOCAB_SIZE:
            raise MinigptError(f"more ranks than a tokenizer may have ({MAX_VOCAB_SIZE:,})")
    if not ranks:
        raise MinigptError("the file is empty")
    return ranks


def tokenizer_from_json(data: Any, source: str | Path = "tokenizer.json") -> Tokenizer:
    """Rebuild a tokenizer from what `Tokenizer.to_json` wrote, or from the Hugging Face tokenizer.json a
    run folder holds (minigpt.hftokenizer), checked through: anything else is a one-line MinigptError
    naming `source`.
    """
    fix = "the file is damaged or was not written by minigpt"
    if isinstance(data, dict) and "model" in data and "kind" not in data:
        from minigpt.hftokenizer import tokenizer_from_hf_json

        return tokenizer_from_hf_json(data, source, fix=fix)
    with naming(source, fix):
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind == "char":
            chars, specials = data.get("chars"), data.get("specials", {})
            if not isinstance(chars, list) or not isinstance(specials, dict):
                raise MinigptError("a char tokenizer needs a list of characters (and control tokens by name)")
            return CharTokenizer(chars, specials)
        if kind == "bpe":
            return BPETokenizer.from_json(data)
        if kind == "tiktoken":
            return TiktokenTokenizer.from_json(data)
        raise MinigptError(f"unknown tokenizer kind {shorten(kind)}")


def load_tokenizer_file(path: Path) -> Tokenizer:
    """The tokenizer a minigpt tokenizer.json holds, read with a size bound and checked through."""
    return tokenizer_from_json(read_json(path), path)


def tokenizer_kind(spec: str) -> str:
    """'char', 'bpe', 'tiktoken' or 'file' for a --tokenizer value (a UsageError for anything else)."""
    if spec in ("char", "bpe"):
        return spec
    if spec.endswith(".json"):
        return "file"  # a minigpt tokenizer.json: a run's, or one `minigpt prepare` names
    if spec in NAMED_ENCODINGS or spec.endswith(".tiktoken") or os.sep in spec or _is_file(spec):
        return "tiktoken"
    raise UsageError(f"unknown --tokenizer {spec!r}; choose {TOKENIZER_CHOICES}")


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except OSError:  # e.g. a name too long for the filesystem: no file by that name
        return False


def build_tokenizer(
    spec: str, texts: Callable[[], Iterable[str]] | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """The tokenizer a --tokenizer value names: char and bpe learn from `texts()` (the training text in
    chunks); named encodings and .tiktoken files load offline. vocab_size applies to bpe only.
    """
    kind = tokenizer_kind(spec)
    if vocab_size is not None and kind != "bpe":
        raise UsageError(f"--vocab-size only applies to --tokenizer bpe (the {spec} vocabulary is fixed)")
    if kind == "file":
        return load_tokenizer_file(Path(spec))
    if kind == "tiktoken":
        if spec in NAMED_ENCODINGS:
            return TiktokenTokenizer.from_name(spec)
        return TiktokenTokenizer.from_file(spec)
    if kind == "bpe":
        check_bpe_vocab_size(DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
    if texts is None:
        raise UsageError(f"--tokenizer {spec} is learned from the training text, and none was given")
    if kind == "char":
        return CharTokenizer.from_texts(texts())
    return BPETokenizer.train(texts(), DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
