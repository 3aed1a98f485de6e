"""A tokenizer from what names it: a --tokenizer value, a tokenizer.json, or text to learn from."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.common.files import read_json
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.base import Tokenizer, naming, shorten
from minigpt.tokenizer.bpe import (
    DEFAULT_BPE_VOCAB_SIZE,
    NAMED_ENCODINGS,
    TOKENIZER_CHOICES,
    BPETokenizer,
    TiktokenTokenizer,
    check_bpe_vocab_size,
)
from minigpt.tokenizer.char import CharTokenizer

if TYPE_CHECKING:
    pass


def tokenizer_from_json(data: Any, source: str | Path = "tokenizer.json") -> Tokenizer:
    """Rebuild a tokenizer from what `Tokenizer.to_json` wrote, or from the Hugging Face tokenizer.json a
    run folder holds (minigpt.tokenizer.hf), checked through: anything else is a one-line MinigptError
    naming `source`.
    """
    fix = "the file is damaged or was not written by minigpt"
    if isinstance(data, dict) and "model" in data and "kind" not in data:
        from minigpt.tokenizer.hf import tokenizer_from_hf_json

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
