"""Byte-level BPE run by tiktoken: a BPE trained on your text, and the public tiktoken encodings."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.common.files import read_bounded
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.base import (
    ENDOFTEXT,
    MAX_UNUSED_IDS,
    MAX_VOCAB_SIZE,
    Tokenizer,
    default_threads,
    is_id,
    naming,
    shorten,
)

if TYPE_CHECKING:
    import numpy as np
    import tiktoken


# GPT-2's split pattern as tiktoken writes it (r50k_base, p50k_base, gpt2)
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# cl100k_base (GPT-4) exactly as tiktoken ships it
CL100K_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
# The same splits as CL100K_SPLIT_PATTERN (tests check this on random text) without the possessive
# quantifiers that cannot change a match there, which tiktoken's regex engine runs faster.
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

# small models gain most from a small vocabulary: at equal CPU time it gives the lowest validation bits per
# byte (bench/bench_tokenizers.py compares sizes)
DEFAULT_BPE_VOCAB_SIZE = 512
MAX_BPE_VOCAB_SIZE = 1 << 32  # token ids are stored as 32-bit integers


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
        # straight from the ranks: to_json's base64 of a large vocabulary costs far more than its bytes' hash
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


def _check_ids(ranks: dict[bytes, int], specials: dict[str, int]) -> None:
    """Ids tiktoken can hold and a model can embed: distinct, in range, dense, all 256 byte tokens."""
    if not all(isinstance(t, bytes) and t for t in ranks):
        raise MinigptError("ranked tokens must be non-empty byte strings")
    if not all(isinstance(s, str) and s for s in specials):
        raise MinigptError("special token names must be non-empty strings")
    ids = [*ranks.values(), *specials.values()]
    bad = [i for i in ids if not is_id(i)]
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
    """Raise a UsageError unless vocab_size can hold the 256 byte tokens plus <|endoftext|>, and its ids
    fit the token store's 32-bit integers."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise UsageError(
            f"--vocab-size {vocab_size} is too small for --tokenizer bpe: it needs at least 257 "
            f"(256 byte tokens + <|endoftext|>); {DEFAULT_BPE_VOCAB_SIZE} is a good start for small models"
        )
    if vocab_size > MAX_BPE_VOCAB_SIZE:
        raise UsageError(
            f"--vocab-size {vocab_size} is past the {MAX_BPE_VOCAB_SIZE:,} ids tokens are stored as; "
            f"{DEFAULT_BPE_VOCAB_SIZE} is a good start for small models"
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
