"""DataConfig: where the training text is and how to read and tokenize it (each field a `train` option);
importable without NumPy, so the command line is built without loading the data pipeline."""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import UsageError
from minigpt.settings import DATA, setting

ERRORS_CHOICES = ("strict", "replace", "ignore")
# bpe at 512 gave the lowest validation bits per byte for equal CPU time (bench/bench_tokenizers.py)
DEFAULT_BPE_VOCAB_SIZE = 512


@dataclass(frozen=True)
class DataConfig:
    """Where the text is and how to read and tokenize it."""

    paths: tuple[Path, ...]  # files and/or directories of .txt files, or conversation JSONL files
    tokenizer: str = setting(
        "bpe", "char, bpe (trained on your text), gpt2/r50k_base/p50k_base/cl100k_base/o200k_base, or a "
        ".tiktoken file.", panel=DATA,
    )  # fmt: skip
    vocab_size: int | None = setting(
        None, "Vocabulary size for --tokenizer bpe.", panel=DATA, shown=str(DEFAULT_BPE_VOCAB_SIZE)
    )
    val_fraction: float = setting(0.1, "Last fraction of the text held out for validation.", panel=DATA)
    val_file: Path | None = setting(None, "Validate on this text instead of a held-out fraction.", panel=DATA)
    encoding: str = setting("utf-8", "Text encoding of the input files.", panel=DATA)
    errors: str = setting(
        "strict", "strict: stop at undecodable bytes; replace: substitute U+FFFD.", panel=DATA,
        flags=("--encoding-errors",), choices=ERRORS_CHOICES,
    )  # fmt: skip
    skip_bad_records: bool = setting(
        False, "Conversation JSONL: skip bad records (counted, the first one named) instead of stopping at the "
        "first.", panel=DATA, flags=("--skip-bad-records",),
    )  # fmt: skip
    cache_dir: Path | None = None  # default: $MINIGPT_CACHE_DIR or ~/.cache/minigpt

    def __post_init__(self) -> None:
        from minigpt.tokenizer import check_bpe_vocab_size, tokenizer_kind

        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))
        for name in ("val_file", "cache_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if not self.paths:
            raise UsageError(
                "no training text given: pass one or more text files or directories of .txt files"
            )
        if self.val_file is None and not (
            isinstance(self.val_fraction, (int, float)) and 0 < self.val_fraction < 1
        ):
            raise UsageError(f"--val-fraction must be between 0 and 1 (exclusive), not {self.val_fraction!r}")
        check_encoding(self.encoding)
        if self.errors not in ERRORS_CHOICES:
            raise UsageError(
                f"--encoding-errors must be one of {', '.join(ERRORS_CHOICES)}, not {self.errors!r}"
            )
        kind = tokenizer_kind(self.tokenizer)
        if self.vocab_size is not None:
            if kind != "bpe":
                raise UsageError(f"--vocab-size only applies to --tokenizer bpe, not {self.tokenizer}")
            check_bpe_vocab_size(self.vocab_size)

    @property
    def cache_root(self) -> Path:
        """The cache directory in effect."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()


def check_encoding(encoding: str) -> None:
    """A UsageError unless encoding names a codec that decodes bytes to text (codecs also holds
    bytes-to-bytes ones such as base64 and zlib, and 'undefined', which refuses everything)."""
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise UsageError(f"unknown --encoding {encoding!r}; try utf-8, utf-16 or latin-1") from None
    try:
        text = codecs.getincrementaldecoder(encoding)().decode(b"", final=True)
    except (UnicodeError, TypeError, ValueError):  # 'undefined', rot13 (str to str), uu
        text = None
    if not isinstance(text, str):
        raise UsageError(
            f"--encoding {encoding!r} does not decode bytes to text; try utf-8, utf-16 or latin-1"
        )


def default_cache_dir() -> Path:
    """$MINIGPT_CACHE_DIR, else ~/.cache/minigpt."""
    env = os.environ.get("MINIGPT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "minigpt"
