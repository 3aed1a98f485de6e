"""Training text as token ids: data settings, preparing a corpus into the token store, splits and batches.

The corpus itself (file formats, the token store, tokenizing beside training, progress) lives in
minigpt.corpus; this module is the dataset and sampler API that training and evaluation use.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minigpt.corpus.ingest import Ingest, Share
from minigpt.corpus.inputs import Source, collect_files, hash_sources
from minigpt.corpus.progress import Progress, text_size
from minigpt.corpus.readers import ReadOptions, documents
from minigpt.corpus.sample import corpus_texts, sample_texts
from minigpt.corpus.store import STORE_FORMAT, Entry, content_key, remove_stale_temps, write_json_atomic
from minigpt.corpus.streams import GrowingStream, TokenStream, split_first_documents
from minigpt.dataconfig import DEFAULT_BPE_VOCAB_SIZE, DataConfig, check_encoding
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer import (
    Tokenizer,
    build_tokenizer,
    default_threads,
    load_tokenizer_file,
    tokenizer_kind,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchSampler",
    "DataConfig",
    "Dataset",
    "bits_per_byte",
    "eval_batches",
    "prepare_data",
    "text_size",
]

VAL_MAX_BYTES = 32 << 20  # validation text held out at most, whatever --val-fraction says
TOKENIZER_FORMAT = 2  # bump when the same text and settings would train another tokenizer


@dataclass
class Dataset:
    """Token ids of the training and validation text, memory-mapped from the token store.

    `train` may still be growing when a run starts before tokenizing ends (see minigpt.corpus.streams):
    the batch sampler then waits, where it must, for the chunks its batch draws from.
    """

    tokenizer: Tokenizer
    train: GrowingStream
    val: TokenStream
    val_bytes: int  # UTF-8 bytes of the validation text
    store: Path  # the token store's folder
    # each input file: absolute path, role (train or val), size and sha256, recorded so a resume can tell
    # whether the text changed and find it again after the run moved
    inputs: tuple[dict[str, Any], ...] = ()
    ingest: Ingest | None = None

    @property
    def val_bytes_per_token(self) -> float:
        """UTF-8 bytes per validation token: divide loss in bits/token by this to get bits/byte."""
        return self.val_bytes / len(self.val)

    @property
    def complete(self) -> bool:
        """Whether every training token is in the store (false while tokenizing runs beside training)."""
        return self.train.complete

    @property
    def tokenized_at_start(self) -> bool:
        """Whether the store held the whole corpus before this call: a run then samples from all of it."""
        return self.ingest is None or self.ingest.complete_at_start

    def status(self) -> str | None:
        """How far tokenizing has come, in words, while it runs; None once it is done."""
        return None if self.ingest is None or self.complete else self.ingest.status()

    def close(self) -> None:
        """Stop tokenizing in the background (what is done stays in the store)."""
        if self.ingest is not None:
            self.ingest.stop()


def bits_per_byte(loss_nats_per_token: float, tokens: int, num_bytes: int) -> float:
    """Convert a mean loss over `tokens` tokens that spell `num_bytes` bytes of text to bits per byte."""
    if tokens <= 0 or num_bytes <= 0:
        raise ValueError("bits_per_byte needs a positive token and byte count")
    return loss_nats_per_token * tokens / (num_bytes * math.log(2))


def read_text(paths: Iterable[Path], encoding: str = "utf-8", errors: str = "strict") -> str:
    """The whole text of corpus files (or folders of them), checked as training input is; documents joined by
    newlines."""
    check_encoding(encoding)
    opts = ReadOptions(encoding, errors)
    docs: list[str] = []
    for src in hash_sources(collect_files(Path(p) for p in paths), encoding, lambda n: None, 1):
        current: list[str] = []
        for piece in documents(src, opts, lambda n: None):
            if piece is None:
                docs.append("".join(current))
                current = []
            else:
                current.append(piece)
    return "\n".join(docs)


# ---------------------------------------------------------------------------------------------- preparing


@dataclass(frozen=True)
class Inputs:
    """The training and validation files of a DataConfig, hashed."""

    train: list[Source]
    val: list[Source]


def hash_inputs(config: DataConfig, progress: bool | Progress = True, share: Share = Share()) -> Inputs:
    """Find the input files and hash them by content (each bad path a one-line error)."""
    report = progress if isinstance(progress, Progress) else Progress(progress)
    train_files = collect_files(config.paths)
    val_files = collect_files([config.val_file]) if config.val_file is not None else []
    both = {f.resolve() for f in train_files} & {f.resolve() for f in val_files}
    if both:
        raise UsageError(f"{next(iter(both))} is both training and validation text; pick one or the other")
    files = train_files + val_files
    total = sum(f.stat().st_size for f in files)
    threads = max(1, default_threads() // share.count)
    with report.phase("hashing inputs", total) as meter:
        sources = hash_sources(files, config.encoding, meter, threads)
    return Inputs(sources[: len(train_files)], sources[len(train_files) :])


def prepare_tokenizer(config: DataConfig, inputs: Inputs, progress: bool | Progress = True) -> Tokenizer:
    """The tokenizer config names: loaded, or learned from the training files (and cached by content)."""
    report = progress if isinstance(progress, Progress) else Progress(progress)
    try:
        return _get_tokenizer(config, inputs, report)
    except OSError as e:  # an unwritable or full cache
        raise _cache_error(e, config.cache_root) from None


def prepare_data(
    config: DataConfig,
    block_size: int,
    tokenizer: Tokenizer | None = None,
    progress: bool | Progress = True,
    *,
    background: bool = False,
    share: Share = Share(),
    inputs: Inputs | None = None,
) -> Dataset:
    """Check and hash the inputs (unless `inputs` has them), build the tokenizer (or use the one given, e.g.
    on resume or fine-tuning), tokenize into the token store what is not there yet, and split off validation.

    With `background`, this returns once the validation text and the first training chunk are tokenized and
    the rest goes on beside training (Dataset.close() stops it); else everything is tokenized first. `share`
    is this process's part of the files under torchrun: the others tokenize the rest into the same store.
    Every bad input is a one-line MinigptError naming the file (and line); a bad file found before tokenizing
    starts leaves nothing written.

    With --val-fraction, validation is whole documents from the start of the corpus (the files in content-
    hash order); with --val-file, that text. BPE learns from up to --tokenizer-sample bytes drawn evenly
    from the training files, char from all of their text.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UsageError(f"--block-size must be a positive integer, not {block_size!r}")
    report = progress if isinstance(progress, Progress) else Progress(progress)
    inputs = inputs if inputs is not None else hash_inputs(config, report, share)
    root = config.cache_root
    for part in ("tokenizers", "tokens"):
        remove_stale_temps(root / part)
    tokenizer = tokenizer if tokenizer is not None else prepare_tokenizer(config, inputs, report)
    ingest = None
    try:
        ingest = _ingest(config, tokenizer, inputs.train, inputs.val, report, share)
        ingest.run(background)
        dataset = _split(config, tokenizer, ingest, len(inputs.val), block_size)
    except BaseException as e:
        if ingest is not None:
            ingest.stop()
        if isinstance(e, OSError):  # an unwritable or full cache
            raise _cache_error(e, root) from None
        raise
    dataset.inputs = tuple(_input_record(s, "train") for s in inputs.train) + tuple(
        _input_record(s, "val") for s in inputs.val
    )
    return dataset


def _cache_error(e: OSError, root: Path) -> MinigptError:
    where = Path(e.filename) if e.filename else root
    fix = (
        "; set MINIGPT_CACHE_DIR to a writable folder with free space"
        if root in (where, *where.parents)
        else ""
    )
    return MinigptError(f"cannot access {where}: {e.strerror or e}{fix}")


def tokenizer_path(config: DataConfig, inputs: Inputs) -> Path | None:
    """Where the tokenizer learned from these inputs with these settings is cached (None: nothing to learn)."""
    kind = tokenizer_kind(config.tokenizer)
    if kind not in ("bpe", "char"):
        return None
    opts = config.read_options
    key = content_key(
        {
            "format": TOKENIZER_FORMAT,
            "tokenizer": kind,
            "vocab_size": (config.vocab_size or DEFAULT_BPE_VOCAB_SIZE) if kind == "bpe" else None,
            "sample": config.tokenizer_sample if kind == "bpe" else None,
            "read": [opts.key(s.format) for s in inputs.train],
            "inputs": [s.digest for s in inputs.train],
        }
    )
    return config.cache_root / "tokenizers" / f"{key}.json"


def _get_tokenizer(config: DataConfig, inputs: Inputs, report: Progress) -> Tokenizer:
    path = tokenizer_path(config, inputs)
    if path is None:  # fixed vocabularies: nothing to learn
        return build_tokenizer(config.tokenizer, None, None)
    if path.is_file():
        try:
            tok = load_tokenizer_file(path)
            report.note(f"reusing the {tok.describe()} tokenizer built earlier from this text ({path})")
            return tok
        except MinigptError:  # a damaged entry is built again
            pass
    kind, sources, opts = tokenizer_kind(config.tokenizer), inputs.train, config.read_options
    total = sum(s.size for s in sources)
    sampled = kind == "bpe" and total > config.tokenizer_sample
    vocab = config.vocab_size or DEFAULT_BPE_VOCAB_SIZE
    label = "building char vocabulary" if kind == "char" else f"training bpe tokenizer ({vocab:,} tokens)"
    with report.phase(label, _sample_bytes(sources, config.tokenizer_sample) if sampled else total) as meter:

        def texts() -> Iterator[str]:
            if kind == "char":
                return corpus_texts(sources, opts, meter)
            return sample_texts(sources, opts, config.tokenizer_sample, meter)

        tok = build_tokenizer(config.tokenizer, texts, config.vocab_size)
    sample = f"a {text_size(config.tokenizer_sample)} sample of " if sampled else ""
    seconds = meter.clock() - meter.started
    report.note(f"{label}: {tok.describe()} from {sample}{text_size(total)} in {seconds:.1f}s")
    write_json_atomic(path, tok.to_json())
    return tok


def _sample_bytes(sources: Sequence[Source], budget: int) -> int:
    """Bytes the sample reads: its share of each plain file, all of each compressed one (read through)."""
    total = sum(s.size for s in sources)
    return sum(s.size if s.compression else budget * s.size // total for s in sources)


def _ingest(
    config: DataConfig,
    tokenizer: Tokenizer,
    train_src: list[Source],
    val_src: list[Source],
    report: Progress,
    share: Share,
) -> Ingest:
    """The files in tokenizing order (validation files first, then training files by content hash) and
    their store entries."""
    digest = tokenizer.digest()
    opts = config.read_options
    ordered = val_src + sorted(train_src, key=lambda s: (s.digest, str(s.path)))
    roles = ["validation"] * len(val_src) + ["training"] * len(train_src)
    root = config.cache_root / "tokens"
    entries = [
        Entry(
            root,
            content_key(
                {
                    "format": STORE_FORMAT,
                    "tokenizer": digest,
                    "file": s.digest,
                    "as": [s.format, s.compression],
                    "read": opts.key(s.format),
                }
            ),
            tokenizer.vocab_size,
        )
        for s in ordered
    ]
    threads = max(1, default_threads() // share.count)
    return Ingest(ordered, entries, tokenizer, opts, report, share, threads, roles)


def _split(config: DataConfig, tokenizer: Tokenizer, ingest: Ingest, n_val: int, block_size: int) -> Dataset:
    lengths = tokenizer.text_byte_lengths()
    dtype = ingest.entries[0].dtype
    if n_val:
        val = TokenStream(dtype)
        val_bytes = 0
        for _, _, chunk in ingest.walk(0, n_val):
            val.append(chunk.ids(dtype))
            val_bytes += chunk.text_bytes
        start = (n_val, 0, 0)
    else:
        on_disk = sum(s.size for s in ingest.sources)
        budget = max(1, min(int(on_disk * config.val_fraction), VAL_MAX_BYTES))
        split = split_first_documents(ingest, budget, config.val_fraction, lengths)
        val, val_bytes, start = split.val, split.val_bytes, split.train_start
    train = GrowingStream(ingest, *start, dtype)
    while not train.complete and train.total <= block_size:
        train.refresh(wait=True)
    _check_long_enough(config, block_size, train, len(val))
    train.limit = train.total
    return Dataset(tokenizer, train, val, val_bytes, config.cache_root / "tokens", (), ingest)


def _input_record(src: Source, role: str) -> dict[str, Any]:
    return {"path": str(src.path.resolve()), "role": role, "bytes": src.size, "sha256": src.digest}


def changed_inputs(saved: Any, now: Sequence[dict[str, Any]]) -> str | None:
    """What differs between the inputs a run recorded and the ones found now (by content, not by path),
    in words; None when the same text is there (a run saved before inputs were recorded counts as same)."""
    if not isinstance(saved, list) or not saved:
        return None

    def contents(records: Sequence[Any]) -> list[tuple[str, str]]:
        return sorted((str(r.get("role")), str(r.get("sha256"))) for r in records if isinstance(r, dict))

    if contents(saved) == contents(now):
        return None
    old = {r.get("sha256"): r for r in saved if isinstance(r, dict)}
    new = {r["sha256"]: r for r in now}
    gone = [Path(str(r.get("path"))).name for h, r in old.items() if h not in new]
    added = [Path(r["path"]).name for h, r in new.items() if h not in old]
    parts = ([f"changed or missing: {', '.join(gone)}"] if gone else []) + (
        [f"new: {', '.join(added)}"] if added else []
    )
    return "; ".join(parts) or "the files' roles differ"


def _check_long_enough(config: DataConfig, block_size: int, train: GrowingStream, n_val: int) -> None:
    n_train = train.total
    if min(n_train, n_val) > block_size:
        return
    fit = min(n_train, n_val) - 1
    fix = f"use --block-size {fit} or less, or give more text" if fit >= 1 else "give more text"
    if config.val_file is None:
        raise MinigptError(
            f"the text is only {n_train + n_val:,} tokens ({n_train:,} train + {n_val:,} validation at "
            f"--val-fraction {config.val_fraction:g}): too short for --block-size {block_size} plus a "
            f"validation split, each needs block size + 1 tokens; {fix}"
        )
    raise MinigptError(
        f"the training text is {n_train:,} tokens and the validation file {n_val:,}: too short for "
        f"--block-size {block_size}, each needs block size + 1 tokens; {fix}"
    )


# ---------------------------------------------------------------------------------------------- batches


def _window_batch(
    tokens: np.ndarray, starts: Sequence[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    buf = np.empty((len(starts), block_size + 1), dtype=np.int64)
    for row, s in enumerate(starts):
        buf[row] = tokens[s : s + block_size + 1]
    t = torch.from_numpy(buf)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class BatchSampler:
    """Random windows of block_size+1 tokens, drawn with a torch.Generator seeded from (seed, rank, batch).

    Reseeding per batch makes the state just the number of batches drawn (and whether the run follows the
    availability schedule of a corpus still being tokenized, `ramp`), the same on every rank: saving rank
    0's state resumes every rank exactly, and rank r of world_size draws its own windows.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        ramp: bool = False,
    ) -> None:
        import torch

        for name, value, least in (
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("world_size", world_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UsageError(f"{name} must be a positive integer, not {value!r}")
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is outside world size {world_size}")
        if len(tokens) < block_size + 1:
            raise MinigptError(
                f"{len(tokens):,} tokens are too few for one window of block size {block_size} + 1; "
                f"use --block-size {max(len(tokens) - 1, 1)} or less, or give more text"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.batches = 0
        self.ramp = ramp
        self._gen = torch.Generator()

    def _batch_seed(self, index: int) -> int:
        text = f"minigpt-batches:{self.seed}:{self.rank}:{index}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 CPU tensors of shape (batch_size, block_size), y shifted one token on."""
        import torch

        if isinstance(self.tokens, GrowingStream):
            per_batch = self.batch_size * self.block_size * self.world_size
            length = self.tokens.length_for(self.batches, self.ramp, per_batch)
        else:
            length = len(self.tokens)
        self._gen.manual_seed(self._batch_seed(self.batches))
        self.batches += 1
        high = length - self.block_size  # starts in [0, high) keep the window in range
        starts = torch.randint(0, high, (self.batch_size,), generator=self._gen).tolist()
        return _window_batch(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        import torch

        return {
            "batches": torch.tensor([self.batches], dtype=torch.int64),
            "ramp": torch.tensor([int(self.ramp)], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        value = state.get("batches") if isinstance(state, dict) else None
        if value is None or value.numel() != 1 or int(value.item()) < 0:
            raise MinigptError("the saved batch sampler state is damaged (no batch count); start a new run")
        self.batches = int(value.item())
        ramp = state.get("ramp")  # absent in states saved before corpora were tokenized beside training
        self.ramp = ramp is not None and ramp.numel() == 1 and bool(ramp.item())


def eval_batches(
    tokens: np.ndarray,
    block_size: int,
    batch_size: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    chunk: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (x, y) batches over back-to-back windows of the tokens, so each token is predicted
    at most once. With max_batches, an evenly spaced subset of max_batches x batch_size windows (per
    rank); ranks share windows out. `chunk` windows go in each yielded batch (default batch_size): which
    windows are evaluated does not depend on it, only how many run in one forward pass.
    """
    windows = (len(tokens) - 1) // block_size
    starts = np.arange(windows, dtype=np.int64) * block_size
    if max_batches is not None:
        wanted = max_batches * batch_size * world_size
        if wanted < windows:
            starts = starts[np.unique(np.linspace(0, windows - 1, wanted).round().astype(np.int64))]
    mine = starts[rank::world_size].tolist()
    step = chunk or batch_size
    for i in range(0, len(mine), step):
        yield _window_batch(tokens, mine[i : i + step], block_size)
