"""Hugging Face's tokenizer files for minigpt's tokenizers, written and read by minigpt itself.

`tokenizer.json` (the `tokenizers` library's format, what transformers' fast tokenizers load) describes
every minigpt tokenizer exactly:

- a byte-level BPE (`bpe`, the tiktoken encodings, .tiktoken files): a `Split` pre-tokenizer with the
  tokenizer's own split pattern, then `ByteLevel` (GPT-2's byte-to-character map, no regex of its own), a
  BPE model whose vocabulary is the ranks (id = rank) and whose merges are the pair tiktoken would join to
  make each token, with `ignore_merges` (tiktoken takes a piece that is itself a token whole), and the
  special tokens as added tokens;
- `char`: a BPE model with one token per character and no merges, so every character is its own token, and
  a `Fuse` decoder.

The run folder's own tokenizer.json is this file too, plus a `minigpt` entry inside `model` (which the
`tokenizers` library ignores) naming minigpt's tokenizer kind, so `AutoTokenizer.from_pretrained(RUN)` works
and minigpt reads back the very tokenizer it saved. Files written elsewhere (transformers' save_pretrained,
GPT-2's vocab.json + merges.txt) are read as the tokenizer they describe, when minigpt can run it.

The same byte-level tables (every id's token as GPT-2's printable characters, and the merges) are what a
GGUF file's `tokenizer.ggml.*` keys hold; `byte_level_tables` gives them for every kind, char included.
"""

from __future__ import annotations

import base64
import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from minigpt.errors import MinigptError
from minigpt.tokenizer.base import ENDOFTEXT, Tokenizer, naming, shorten
from minigpt.tokenizer.bpe import (
    CL100K_SPLIT_PATTERN,
    GPT2_SPLIT_PATTERN,
    GPT4_SPLIT_PATTERN,
    KNOWN_SPLIT_PATTERNS,
    NAMED_ENCODINGS,
    BPETokenizer,
    TiktokenTokenizer,
    _RankedBPE,
)
from minigpt.tokenizer.char import CharTokenizer

__all__ = [
    "HF_MERGES",
    "HF_SPECIAL_TOKENS",
    "HF_TOKENIZER_CONFIG",
    "HF_TOKENIZER_JSON",
    "HF_VOCAB",
    "ByteLevelTables",
    "bpe_vocab_merges",
    "byte_level_tables",
    "bytes_to_unicode",
    "hf_split_pattern",
    "hf_tokenizer_files",
    "ranks_from_vocab_merges",
    "tokenizer_config",
    "tokenizer_from_hf_json",
    "tokenizer_from_vocab_merges",
    "tokenizer_json",
]

HF_TOKENIZER_JSON = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"
HF_VOCAB = "vocab.json"
HF_MERGES = "merges.txt"

# HF's tokenizers runs split patterns with Oniguruma (Ruby syntax), where `X{1,3}+` is "one or more runs of
# 1-3 X", not tiktoken's possessive {1,3}: written there without the `+`, which cannot change a match
# (nothing after it in its alternative could make the regex backtrack into it). `?+`, `++`, `*+` are
# possessive in both.
_HF_PATTERNS = {p: p.replace(r"\p{N}{1,3}+", r"\p{N}{1,3}") for p in KNOWN_SPLIT_PATTERNS}
_FROM_HF_PATTERNS = {hf: p for p, hf in _HF_PATTERNS.items() if p != CL100K_SPLIT_PATTERN}
_FROM_HF_PATTERNS[_HF_PATTERNS[CL100K_SPLIT_PATTERN]] = CL100K_SPLIT_PATTERN
_KINDS = ("bpe", "tiktoken", "char")


# ---------------------------------------------------------------- GPT-2's byte-level strings


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (vocab.json, merges.txt,
    tokenizer.json's byte-level vocabularies and GGUF's tokens all use it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _decode_table() -> dict[int, int]:
    """str.translate table from GPT-2's characters to the latin-1 characters of their bytes; the code points
    below 256 that are not among GPT-2's characters go to U+FFFF, which latin-1 cannot encode."""
    table = {ord(c): b for b, c in bytes_to_unicode().items()}
    return {**{i: 0xFFFF for i in range(256)}, **table}


def token_text(token: bytes) -> str:
    """A token's bytes as GPT-2's printable characters."""
    # latin-1 turns each byte into the code point of the same number, which translate then maps
    return token.decode("latin-1").translate(bytes_to_unicode())


def _token_bytes(text: str) -> bytes | None:
    """The bytes of a byte-level token string, or None if it is not one."""
    try:
        return text.translate(_decode_table()).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _split_below(token: bytes, ranks: dict[bytes, int], limit: int) -> list[bytes]:
    """Byte-level BPE of token using only the ranks below limit (how tiktoken would build it)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], limit)
            if r < best_rank:
                best_rank, best_i = r, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order: the two parts tiktoken joins to make it,
    found by running BPE on its bytes with the ranks below its own. A token that does not come out as
    exactly two parts can never be produced by BPE, so the ranks have no merges equivalent (MinigptError)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _split_below(token, ranks, rank)
            if len(parts) != 2:
                raise MinigptError(f"token {token!r} (rank {rank}) is not the merge of two earlier tokens")
            merges.append((parts[0], parts[1]))
    return merges


def _vocab(ranks: dict[bytes, int]) -> dict[str, int]:
    return {token_text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}


def _merge_lines(pairs: list[tuple[bytes, bytes]]) -> list[str]:
    return [f"{token_text(a)} {token_text(b)}" for a, b in pairs]


def bpe_vocab_merges(ranks: dict[bytes, int], specials: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """vocab.json and merges.txt entries (GPT-2's files) equivalent to tiktoken ranks."""
    return {**_vocab(ranks), **specials}, _merge_lines(_bpe_merges(ranks))


def ranks_from_vocab_merges(
    vocab: dict[str, int], merges: Sequence[tuple[str, str]], source: Path
) -> tuple[dict[bytes, int], dict[str, int]]:
    """tiktoken ranks and special tokens from a byte-level BPE's vocabulary and merges.

    tiktoken merges by the rank of the joined token, transformers by the order of the merges; the two
    agree when each merge's result has a higher id than its parts and ids grow along the merges, which
    is checked (GPT-2's own files satisfy it: tiktoken's r50k_base was made from them).
    """
    results = {a + b for a, b in merges}
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise MinigptError(f"{source}: id of {shorten(text)} is not an integer")
        if (len(text) == 1 and text in _unicode_to_bytes()) or text in results:
            token = _token_bytes(text)
            if token is None:
                raise MinigptError(f"{source}: {shorten(text)} is not a byte-level BPE token")
            ranks[token] = i
        else:
            specials[text] = i
    last = -1
    for a, b in merges:
        ids = [vocab.get(a), vocab.get(b), vocab.get(a + b)]
        if None in ids:
            raise MinigptError(f"{source}: merge '{a} {b}' uses tokens that are not in the vocabulary")
        ia, ib, ic = ids
        if not (ia < ic and ib < ic and ic > last):  # type: ignore[operator]
            raise MinigptError(
                f"{source}: merge '{a} {b}' is out of id order, so tiktoken ranks cannot reproduce it"
            )
        last = ic  # type: ignore[assignment]
    return ranks, specials


@dataclass(frozen=True)
class ByteLevelTables:
    """A tokenizer as a byte-level BPE: every id's token (GPT-2's printable characters; `[PAD<id>]` for an
    id nothing uses), its kind ("normal", "control" for special tokens, "unused") and the merges, in order."""

    tokens: list[str]
    kinds: list[str]
    merges: list[str]


def byte_level_tables(tok: Tokenizer, vocab_size: int) -> ByteLevelTables:
    """`tok` as a byte-level BPE over `vocab_size` ids (the model's; the tokenizer may use fewer).

    A char tokenizer's tokens are its characters' UTF-8 bytes; a character of several bytes is built by a
    chain of merges from its first byte on (the pieces between need not be tokens: llama.cpp merges strings),
    so BPE gives back exactly one token per character.
    """
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    kinds = ["unused"] * vocab_size
    merges: list[str] = []
    if isinstance(tok, CharTokenizer):
        seen: set[str] = set()
        for i, char in enumerate(tok.chars):
            data = char.encode("utf-8")
            tokens[i], kinds[i] = token_text(data), "normal"
            for n in range(1, len(data)):
                merge = f"{token_text(data[:n])} {token_text(data[n : n + 1])}"
                if merge not in seen:
                    seen.add(merge)
                    merges.append(merge)
    else:
        assert isinstance(tok, _RankedBPE)
        for text, rank in _vocab(tok.ranks).items():
            tokens[rank], kinds[rank] = text, "normal"
        merges = _merge_lines(_cached_merges(tok))
    for text, i in tok.specials.items():
        tokens[i], kinds[i] = text, "control"
    return ByteLevelTables(tokens, kinds, merges)


# one tokenizer's merges are found once per process: a run is saved at every evaluation
_MERGES: weakref.WeakKeyDictionary[Tokenizer, list[tuple[bytes, bytes]]] = weakref.WeakKeyDictionary()


def _cached_merges(tok: _RankedBPE) -> list[tuple[bytes, bytes]]:
    if tok not in _MERGES:
        _MERGES[tok] = _bpe_merges(tok.ranks)
    return _MERGES[tok]


# ---------------------------------------------------------------- tokenizer.json, written


def hf_split_pattern(pattern: str) -> str:
    """The regex HF's tokenizers needs to split text as tiktoken does with `pattern` (a known one)."""
    return _HF_PATTERNS[pattern]


def _added(content: str, i: int) -> dict[str, Any]:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}  # fmt: skip


def _bpe_model(vocab: dict[str, int], merges: list[str], ignore_merges: bool) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges,
    }


def _byte_level(**extra: Any) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False, **extra}


def tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """The `tokenizers` library's tokenizer.json for `tok`: the same ids for every text, the same text for
    every ids. Its `model` carries `minigpt: {kind, name}`, so reading it back gives `tok` itself."""
    if isinstance(tok, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tok.chars)}
        model = {**_bpe_model(vocab, [], False), "minigpt": {"kind": "char"}}
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens_of(tok),
                "normalizer": None, "pre_tokenizer": None, "post_processor": None,
                "decoder": {"type": "Fuse"}, "model": model}  # fmt: skip
    assert isinstance(tok, _RankedBPE)
    vocab, merges = _vocab(tok.ranks), _merge_lines(_cached_merges(tok))
    split = {"type": "Split", "pattern": {"Regex": hf_split_pattern(tok.pattern)}, "behavior": "Isolated",
             "invert": False}  # fmt: skip
    model = {**_bpe_model(vocab, merges, True), "minigpt": {"kind": tok.kind, "name": tok.name}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens_of(tok),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, _byte_level()]},
        "post_processor": None,
        "decoder": _byte_level(),
        "model": model,
    }


def _added_tokens_of(tok: Tokenizer) -> list[dict[str, Any]]:
    return [_added(text, i) for text, i in sorted(tok.specials.items(), key=lambda kv: kv[1])]


def tokenizer_config(tok: Tokenizer, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json; a chat run's (minigpt.chat.template) adds its chat template."""
    eot = ENDOFTEXT if tok.eot_id is not None else None
    added = _added_tokens_of(tok)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "bos_token": eot,
        "eos_token": eot,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        # minigpt encodes "<|endoftext|>" in a text as the text it is, never as the special token
        "split_special_tokens": True,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    return {**config, **_chat_settings(tok)}


def _chat_settings(tok: Tokenizer) -> dict[str, Any]:
    """A chat run's tokenizer settings: the template `apply_chat_template` renders, whose control tokens the
    tokenizer must then read as tokens (so special tokens are not split: a control token's name typed in a
    message is read as the token too, unless the caller passes `sanitize_control_tokens=True`), and the end
    of a turn as the end of what the model generates."""
    from minigpt.chat.template import CHAT_TOKENS, END, ChatTemplate, has_chat_tokens

    if not has_chat_tokens(tok):
        return {}
    return {"chat_template": ChatTemplate.jinja(), "chat_control_tokens": list(CHAT_TOKENS),
            "split_special_tokens": False, "eos_token": END}  # fmt: skip


def hf_tokenizer_files(tok: Tokenizer, max_length: int) -> dict[str, Any]:
    """File name -> JSON content (or text, for merges.txt) of the Hugging Face tokenizer files of `tok`:
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, and for a byte-level BPE with GPT-2's
    split pattern also GPT-2's vocab.json and merges.txt (what GPT2Tokenizer and older tools read)."""
    config = tokenizer_config(tok, max_length)
    ends = {k: config[k] for k in ("bos_token", "eos_token") if config[k] is not None}
    files: dict[str, Any] = {
        HF_TOKENIZER_JSON: tokenizer_json(tok),
        HF_TOKENIZER_CONFIG: config,
        HF_SPECIAL_TOKENS: ends,
    }
    if isinstance(tok, _RankedBPE) and tok.pattern == GPT2_SPLIT_PATTERN:
        merges = _merge_lines(_cached_merges(tok))
        files[HF_VOCAB] = {**_vocab(tok.ranks), **tok.specials}
        files[HF_MERGES] = "#version: 0.2\n" + "".join(m + "\n" for m in merges)
    return files


# ---------------------------------------------------------------- tokenizer.json, read


def _split_regex(pre: Any) -> str | None:
    """The split pattern (minigpt's form) of a byte-level pre-tokenizer, None if it is not one minigpt
    can run. GPT-2's own tokenizer.json has a ByteLevel pre-tokenizer with its built-in regex."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        ok = pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        return GPT2_SPLIT_PATTERN if ok else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(s, dict) for s in steps):
        return None
    split, level = steps
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    plain = split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
    byte_level = level.get("type") == "ByteLevel" and not level.get("use_regex", True)
    if not (plain and byte_level) or level.get("add_prefix_space"):
        return None
    return _FROM_HF_PATTERNS.get(regex) if isinstance(regex, str) else None


def _merge_pairs(merges: Any) -> list[tuple[str, str]]:
    if not isinstance(merges, list):
        raise MinigptError("the BPE model's merges are not a list")
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    if not all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
        raise MinigptError("a merge is not two tokens")
    return pairs  # type: ignore[return-value]


def _added_tokens(data: dict[str, Any]) -> dict[str, int]:
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise MinigptError("added_tokens is not a list of tokens")
    try:
        return {t["content"]: t["id"] for t in added}
    except (KeyError, TypeError):
        raise MinigptError("an added token lacks its content or id") from None


def tokenizer_from_hf_json(
    data: Any,
    source: str | Path,
    name: str = "hf-bpe",
    fix: str = "pass --tokenizer NAME|FILE for the model's tokenizer",
) -> Tokenizer:
    """The minigpt tokenizer a tokenizer.json describes (as `tokenizer_json` writes it, or a byte-level BPE
    as transformers saves GPT-2's and others'), every id and pattern checked; anything minigpt cannot run
    exactly is a one-line MinigptError naming `source` and ending with `fix`. `name` labels a BPE that
    names itself nowhere."""
    with naming(source, fix):
        model = data.get("model") if isinstance(data, dict) else None
        if (
            not isinstance(model, dict)
            or model.get("type") != "BPE"
            or not isinstance(model.get("vocab"), dict)
        ):
            raise MinigptError("not a BPE tokenizer.json minigpt reads (a BPE model with a vocabulary)")
        own = model.get("minigpt") if isinstance(model.get("minigpt"), dict) else {}
        if own.get("kind") not in (None, *_KINDS):
            raise MinigptError(f"unknown minigpt tokenizer kind {shorten(own.get('kind'))}")
        if data.get("normalizer") is not None or model.get("byte_fallback") or model.get("dropout"):
            raise MinigptError("a normalizer, byte fallback or dropout is not something minigpt runs")
        if data.get("pre_tokenizer") is None and own.get("kind", "char") == "char":
            return _char_from_hf(model, data)
        return _bpe_from_hf(model, data, own, source, name)


def _char_from_hf(model: dict[str, Any], data: dict[str, Any]) -> CharTokenizer:
    """A character vocabulary; its added tokens are control tokens (a chat run's), after the characters."""
    if model.get("merges"):
        raise MinigptError("a character vocabulary has no merges")
    vocab = model["vocab"]
    ids = sorted(vocab.values(), key=lambda i: i if isinstance(i, int) else -1)
    if ids != list(range(len(vocab))) or any(isinstance(i, bool) for i in ids):
        raise MinigptError("a character vocabulary's ids must be 0..n-1, each once")
    return CharTokenizer(sorted(vocab, key=vocab.__getitem__), _added_tokens(data))


def _bpe_from_hf(
    model: dict[str, Any], data: dict[str, Any], own: dict[str, Any], source: str | Path, name: str
) -> _RankedBPE:
    pattern = _split_regex(data.get("pre_tokenizer"))
    if pattern is None:
        raise MinigptError(
            "its pre-tokenizer is not a byte-level split minigpt knows (GPT-2's, cl100k's, o200k's or "
            "minigpt's bpe pattern, then ByteLevel)"
        )
    if own.get("kind") in ("bpe", "tiktoken"):
        # minigpt's own file: the vocabulary is the ranks (id = rank), the specials are the added tokens, and
        # the merges follow from the ranks (as the `tokenizers` library uses them, minigpt does not)
        ranks, specials = _ranks_of(model["vocab"]), _added_tokens(data)
    else:
        merges = _merge_pairs(model.get("merges", []))
        ranks, specials = ranks_from_vocab_merges(model["vocab"], merges, Path(source))
        specials.update(_added_tokens(data))
    return _ranked(ranks, specials, pattern, own, name)


def _ranks_of(vocab: dict[str, Any]) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for text, i in vocab.items():
        token = _token_bytes(text)
        if token is None or token in ranks:
            raise MinigptError(f"{shorten(text)} is not a byte-level BPE token, or is one twice")
        ranks[token] = i
    return ranks


def tokenizer_from_vocab_merges(vocab: Any, merges_text: str, source: Path, name: str) -> _RankedBPE:
    """The byte-level BPE GPT-2's vocab.json and merges.txt describe (GPT-2's split pattern)."""
    with naming(source, "pass --tokenizer NAME|FILE for the model's tokenizer"):
        if not isinstance(vocab, dict):
            raise MinigptError("not a GPT-2 style BPE vocabulary (a JSON object of token -> id)")
        lines = [line for line in merges_text.splitlines() if line and not line.startswith("#version")]
        ranks, specials = ranks_from_vocab_merges(vocab, _merge_pairs(lines), source)
        return _ranked(ranks, specials, GPT2_SPLIT_PATTERN, {}, name)


def _ranked(
    ranks: dict[bytes, int], specials: dict[str, int], pattern: str, own: dict[str, Any], name: str
) -> _RankedBPE:
    """The minigpt tokenizer of these ranks: the kind and name the file's `minigpt` entry gives, else a public
    encoding recognised by its ranks, else minigpt's own bpe (its pattern and <|endoftext|> after the ranks),
    else a tiktoken BPE called `name`."""
    kind = own.get("kind")
    own_name = own.get("name") if isinstance(own.get("name"), str) and own.get("name") else None
    # minigpt's bpe: <|endoftext|> right after the ranks, any control tokens (a chat run's) after it
    ours = (
        pattern == GPT4_SPLIT_PATTERN
        and specials.get(ENDOFTEXT) == len(ranks)
        and all(i >= len(ranks) for i in specials.values())
    )
    if kind == "bpe" or (kind is None and ours):
        return BPETokenizer(ranks, pattern, specials, own_name or "bpe")
    named = None if kind == "tiktoken" and own_name else _named_encoding(ranks, specials)
    if named is not None:
        spec = NAMED_ENCODINGS[named]
        return TiktokenTokenizer(own_name or spec.name, spec.pattern, ranks, spec.specials)
    return TiktokenTokenizer(own_name or name, pattern, ranks, specials)


def _named_encoding(ranks: dict[bytes, int], specials: dict[str, int]) -> str | None:
    """The public encoding (r50k_base, cl100k_base, ...) these ranks and specials are, if any."""
    digest = _ranks_sha256(ranks)
    return next(
        (e.name for e in NAMED_ENCODINGS.values() if e.sha256 == digest and e.specials == specials
         and e.name != "gpt2"),
        None,
    )  # fmt: skip


def _ranks_sha256(ranks: dict[bytes, int]) -> str:
    """sha256 of the ranks written as a .tiktoken file (so it matches the published files' hashes)."""
    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return h.hexdigest()
