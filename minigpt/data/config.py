"""DataConfig: where the training text is and how to read and tokenize it (each field a `train` option);
importable without NumPy, so the command line is built without loading the data pipeline."""

from __future__ import annotations

import codecs
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.common.settings import DATA, setting
from minigpt.errors import UsageError
from minigpt.tokenizer.bpe import DEFAULT_BPE_VOCAB_SIZE, check_bpe_vocab_size
from minigpt.tokenizer.load import tokenizer_kind

if TYPE_CHECKING:
    from minigpt.corpus.readers import ReadOptions

ERRORS_CHOICES = ("strict", "replace", "ignore")
# BPE learns from at most this much text, drawn evenly across the corpus: a sample this large already learns
# merges that compress held-out text as well as the whole corpus's would, and bounds the time learning
# takes at any corpus size (bench/bench_corpus.py --sample-cost-mb measures both)
DEFAULT_TOKENIZER_SAMPLE = 64_000_000
MAX_SIZE = 1 << 62  # bytes: past any disk, and within the 64-bit integers sizes are counted in
_SIZE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|k|m|g)?\s*")


def parse_size(text: str | int) -> int:
    """Bytes from '64MB', '1.5GB', '500k' or a bare number of bytes (a UsageError for anything else)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise UsageError(f"{text!r} is not a size; use e.g. 64MB, 1GB or 500000")
    scale = {"k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9}.get((m[2] or "").lower(), 1)
    size = float(m[1]) * scale
    if size > MAX_SIZE:  # a float past its range (inf) would not even convert to an integer
        raise UsageError(f"{str(text)[:40]!r} is past {MAX_SIZE:,} bytes; use e.g. 64MB, 1GB or 500000")
    return int(size)


@dataclass(frozen=True)
class DataConfig:
    """Where the text is and how to read and tokenize it."""

    paths: tuple[Path, ...]  # files and/or folders of .txt, .jsonl/.ndjson and .parquet (also compressed),
    # or conversation JSONL files
    tokenizer: str = setting(
        "bpe", "char, bpe (trained on your text), gpt2/r50k_base/p50k_base/cl100k_base/o200k_base, a "
        ".tiktoken file, or a minigpt tokenizer.json (a run's, or the one `prepare` names).", panel=DATA,
    )  # fmt: skip
    vocab_size: int | None = setting(
        None, "Vocabulary size for --tokenizer bpe.", panel=DATA, shown=str(DEFAULT_BPE_VOCAB_SIZE)
    )
    val_fraction: float = setting(
        0.1, "Fraction of the text held out for validation: whole documents from the end of the corpus (in "
        "the order given), at most 32 MB.", panel=DATA,
    )  # fmt: skip
    val_file: Path | None = setting(None, "Validate on this text instead of a held-out fraction.", panel=DATA)
    encoding: str = setting("utf-8", "Text encoding of plain text files.", panel=DATA)
    errors: str = setting(
        "strict", "strict: stop at undecodable bytes; replace: substitute U+FFFD.", panel=DATA,
        flags=("--encoding-errors",), choices=ERRORS_CHOICES,
    )  # fmt: skip
    text_field: str = setting(
        "text", "The JSON field or Parquet column that holds each document.", panel=DATA
    )
    skip_bad_records: bool = setting(
        False, "Skip (and count) JSON lines, Parquet values and conversations that are not a document or a "
        "valid conversation, instead of stopping at the first.", panel=DATA,
    )  # fmt: skip
    tokenizer_sample: int = setting(
        DEFAULT_TOKENIZER_SAMPLE, "Bytes of text --tokenizer bpe learns from, drawn evenly across the corpus "
        "(e.g. 64MB, 1GB).", panel=DATA, parse=parse_size, metavar="<size>", shown="64MB",
    )  # fmt: skip
    cache_dir: Path | None = None  # default: $MINIGPT_CACHE_DIR or ~/.cache/minigpt

    def __post_init__(self) -> None:
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))
        for name in ("val_file", "cache_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "tokenizer_sample", parse_size(self.tokenizer_sample))
        if not self.paths:
            raise UsageError("no training text given: pass one or more files or folders of text")
        if self.val_file is None and not (
            isinstance(self.val_fraction, (int, float)) and 0 < self.val_fraction < 1
        ):
            raise UsageError(f"--val-fraction must be between 0 and 1 (exclusive), not {self.val_fraction!r}")
        check_encoding(self.encoding)
        if self.errors not in ERRORS_CHOICES:
            raise UsageError(
                f"--encoding-errors must be one of {', '.join(ERRORS_CHOICES)}, not {self.errors!r}"
            )
        if not (isinstance(self.text_field, str) and self.text_field):
            raise UsageError("--text-field must name a JSON field or Parquet column, e.g. text")
        if self.tokenizer_sample < 1_000_000:
            raise UsageError(f"--tokenizer-sample must be at least 1MB, not {self.tokenizer_sample:,} bytes")
        kind = tokenizer_kind(self.tokenizer)
        if self.vocab_size is not None:
            if kind != "bpe":
                raise UsageError(f"--vocab-size only applies to --tokenizer bpe, not {self.tokenizer}")
            check_bpe_vocab_size(self.vocab_size)

    @property
    def cache_root(self) -> Path:
        """The cache directory in effect."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()

    @property
    def read_options(self) -> ReadOptions:
        """How the files are read into documents."""
        from minigpt.corpus.readers import ReadOptions

        return ReadOptions(
            self.encoding, self.errors, self.text_field, self.skip_bad_records, self.cache_root / "spool"
        )


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
