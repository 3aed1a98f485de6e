"""Training text as token ids: data settings, preparing a corpus into the token store, splits and batches.

The corpus itself (file formats, the token store, tokenizing beside training, progress) lives in
minigpt.corpus; this module is the dataset and sampler API that training and evaluation use.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minigpt.corpus.ingest import Ingest, Share
from minigpt.corpus.inputs import Source, collect_files, file_sha256, stamp_sources
from minigpt.corpus.progress import Progress, text_size
from minigpt.corpus.readers import WHOLE, ReadOptions, documents
from minigpt.corpus.sample import corpus_texts, sample_bytes, sample_texts
from minigpt.corpus.split import Part, plan_split
from minigpt.corpus.store import (
    STORE_FORMAT,
    Entry,
    FileHashes,
    content_key,
    remove_stale_temps,
    write_json_atomic,
)
from minigpt.corpus.streams import GrowingStream, TokenStream, validation_stream
from minigpt.data.config import DataConfig, check_encoding, default_cache_dir
from minigpt.data.order import EpochOrder
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.base import Tokenizer, default_threads
from minigpt.tokenizer.bpe import DEFAULT_BPE_VOCAB_SIZE
from minigpt.tokenizer.char import CharTokenizer
from minigpt.tokenizer.load import build_tokenizer, load_tokenizer_file, tokenizer_kind

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchSampler",
    "DataConfig",
    "Dataset",
    "bits_per_byte",
    "eval_batches",
    "eval_rows",
    "prepare_data",
    "text_size",
]

TOKENIZER_FORMAT = 3  # bump when the same text and settings would train another tokenizer


@dataclass
class Dataset:
    """Token ids of the training and validation text, read from the token store a window at a time.

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

    def refresh(self) -> None:
        """Take in the training chunks tokenized since the split was made (all of them once tokenizing is
        done), so what start-up reports counts them; the first batch sets what batches draw from anyway."""
        self.train.refresh()
        self.train.limit = self.train.total

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
    opts = ReadOptions(encoding, errors, spool=default_cache_dir() / "spool")
    docs: list[str] = []
    for src in stamp_sources(collect_files(Path(p) for p in paths), encoding, lambda n: None, 1):
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
    """The training and validation files of a DataConfig, stamped, in the order given."""

    train: list[Source]
    val: list[Source]


def find_inputs(config: DataConfig, progress: bool | Progress = True, share: Share = Share()) -> Inputs:
    """Find the input files and stamp them (a few blocks of each read; each bad path a one-line error)."""
    report = progress if isinstance(progress, Progress) else Progress(progress)
    train_files = collect_files(config.paths)
    val_files = collect_files([config.val_file]) if config.val_file is not None else []
    both = {f.resolve() for f in train_files} & {f.resolve() for f in val_files}
    if both:
        raise UsageError(f"{next(iter(both))} is both training and validation text; pick one or the other")
    files = train_files + val_files
    total = sum(f.stat().st_size for f in files)
    threads = max(1, default_threads() // share.count)
    with report.phase("reading inputs", total) as meter:
        sources = stamp_sources(files, config.encoding, meter, threads)
    return Inputs(sources[: len(train_files)], sources[len(train_files) :])


def prepare_tokenizer(config: DataConfig, inputs: Inputs, progress: bool | Progress = True) -> Tokenizer:
    """The tokenizer config names: loaded, or learned from the training files (and cached by their stamps)."""
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
    """Find and stamp the inputs (unless `inputs` has them), build the tokenizer (or use the one given, e.g.
    on resume or fine-tuning), split off validation, and tokenize into the token store what is not there.

    With `background`, this returns once the validation text and the first training chunk are tokenized and
    the rest goes on beside training (Dataset.close() stops it); else everything is tokenized first. `share`
    is this process's part of the files under torchrun: the others tokenize the rest into the same store.
    Every bad input is a one-line MinigptError naming the file (and line); a bad file found before tokenizing
    starts leaves nothing written.

    With --val-fraction, validation is the end of the corpus in the order given (minigpt.corpus.split);
    with --val-file, that text. BPE learns from up to --tokenizer-sample bytes drawn evenly from the
    training files, char from all of their text.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UsageError(f"--block-size must be a positive integer, not {block_size!r}")
    report = progress if isinstance(progress, Progress) else Progress(progress)
    inputs = inputs if inputs is not None else find_inputs(config, report, share)
    root = config.cache_root
    for part in ("tokenizers", "tokens", "splits", "files", "spool"):
        remove_stale_temps(root / part)
    tokenizer = tokenizer if tokenizer is not None else prepare_tokenizer(config, inputs, report)
    ingest = None
    try:
        sources, parts = _parts(config, inputs, tokenizer, report)
        ingest = _ingest(config, tokenizer, sources, parts, report, share)
        # a store that holds everything is only looked up (a stat per chunk): done before training starts
        ingest.run(background and not ingest.complete_at_start)
        dataset = _split(config, tokenizer, ingest, block_size)
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
            "inputs": [[s.stamp, s.format, s.compression] for s in inputs.train],
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
    kind, sources = tokenizer_kind(config.tokenizer), inputs.train
    total = sum(s.size for s in sources)
    sampled = kind == "bpe" and total > config.tokenizer_sample
    vocab = config.vocab_size or DEFAULT_BPE_VOCAB_SIZE
    label = "building char vocabulary" if kind == "char" else f"training bpe tokenizer ({vocab:,} tokens)"
    started = report.clock()
    size = sample_bytes(sources, config.read_options, config.tokenizer_sample) if sampled else total
    tok, text = _learn_tokenizer(config, sources, report, label, size)
    report.note(
        f"{label}: {tok.describe()} from {_learned_from(sources, text, sampled)} in {report.clock() - started:.1f}s"
    )
    write_json_atomic(path, tok.to_json())
    return tok


def _learn_tokenizer(
    config: DataConfig, sources: list[Source], report: Progress, label: str, size: int
) -> tuple[Tokenizer, int]:
    """The tokenizer learned from the training files (a sample of them for bpe), and the bytes of text it
    learned from: reading is counted in bytes on disk; what comes after it (bpe merging its pairs, which
    reports nothing) shows as a phase of its own, not as a full bar."""
    kind, opts, text = tokenizer_kind(config.tokenizer), config.read_options, 0
    with contextlib.ExitStack() as phases:
        meter = phases.enter_context(report.phase(label, size))

        def texts() -> Iterator[str]:
            nonlocal text
            pieces = (
                corpus_texts(sources, opts, meter)
                if kind == "char"
                else sample_texts(sources, opts, config.tokenizer_sample, meter)
            )
            for piece in pieces:
                text += len(piece.encode("utf-8", "surrogatepass"))
                yield piece
            phases.close()  # all is read: the reading bar goes
            if kind == "bpe":
                phases.enter_context(report.phase(f"{label}: merging pairs of {text_size(text)} of text"))

        return build_tokenizer(config.tokenizer, texts, config.vocab_size), text


def _learned_from(sources: Sequence[Source], text: int, sampled: bool) -> str:
    """What a tokenizer learned from, in words: the text's size (files compressed, Parquet or JSON lines
    are larger or smaller on disk: that size is said apart), or the sample's and the corpus's."""
    disk = sum(s.size for s in sources)
    plain = all(s.format == "text" and s.compression is None for s in sources)
    corpus = text_size(disk) if plain else f"{text_size(disk)} of files on disk"
    if sampled:
        return f"a {text_size(text)} sample of {corpus}"
    return f"{text_size(text)} of text" + ("" if plain else f" ({corpus})")


def _parts(
    config: DataConfig, inputs: Inputs, tokenizer: Tokenizer, report: Progress
) -> tuple[list[Source], list[Part]]:
    """The corpus's files (training files, then --val-file's) and its parts in tokenizing order: validation
    first, then the training parts ordered by the files' fingerprints (a shuffle independent of names)."""
    sources = inputs.train + inputs.val
    if inputs.val:
        val = [Part(len(inputs.train) + i, WHOLE, "validation") for i in range(len(inputs.val))]
        train = [Part(i, WHOLE, "training") for i in range(len(inputs.train))]
    else:
        align = not isinstance(tokenizer, CharTokenizer)  # a BPE's cut moves to where a piece starts
        with report.phase("finding the validation split", _scanned_bytes(config, inputs.train)) as meter:
            planned = plan_split(
                inputs.train,
                config.val_fraction,
                config.read_options,
                align,
                config.cache_root / "splits",
                meter,
            )
        val = [p for p in planned if p.role == "validation"]
        train = [p for p in planned if p.role == "training"]
    train.sort(key=lambda p: (sources[p.source].fingerprint, str(sources[p.source].path)))
    return sources, val + train


def _scanned_bytes(config: DataConfig, sources: list[Source]) -> int:
    """Bytes of the compressed files at the corpus's end that finding the split may decompress through."""
    want, seen, total = sum(s.size for s in sources) * config.val_fraction, 0, 0
    for src in reversed(sources):
        total += src.size if src.compression else 0
        seen += src.size
        if seen >= want:
            break
    return total


def _ingest(
    config: DataConfig,
    tokenizer: Tokenizer,
    sources: list[Source],
    parts: list[Part],
    report: Progress,
    share: Share,
) -> Ingest:
    """The parts and their store entries."""
    digest = tokenizer.digest()
    opts = config.read_options
    root = config.cache_root / "tokens"
    entries = []
    for part in parts:
        src = sources[part.source]
        key = {
            "format": STORE_FORMAT,
            "tokenizer": digest,
            "file": src.stamp,
            "as": [src.format, src.compression],
            "read": opts.key(src.format),
            "span": part.span.key(),
        }
        entries.append(Entry(root, content_key(key), tokenizer.vocab_size))
    threads = max(1, default_threads() // share.count)
    hashes = FileHashes(config.cache_root / "files")
    return Ingest(sources, parts, entries, tokenizer, opts, report, share, threads, hashes)


def _split(config: DataConfig, tokenizer: Tokenizer, ingest: Ingest, block_size: int) -> Dataset:
    n_val = sum(p.role == "validation" for p in ingest.parts)
    val, val_bytes = validation_stream(ingest, n_val)
    train = GrowingStream(ingest, n_val, val.dtype)
    while not train.complete and train.total <= block_size:
        train.refresh(wait=True)
    _check_long_enough(config, block_size, train, len(val))
    train.limit = train.total
    return Dataset(tokenizer, train, val, val_bytes, config.cache_root / "tokens", (), ingest)


def _input_record(src: Source, role: str) -> dict[str, Any]:
    return {"path": str(src.path.resolve()), "role": role, "bytes": src.size, "mtime_ns": src.mtime_ns,
            "fingerprint": src.fingerprint}  # fmt: skip


def changed_inputs(saved: Any, now: Sequence[dict[str, Any]], cache_root: Path) -> str | None:
    """What differs between the inputs a run recorded and the ones found now, in words; None when the same
    text is there. Files are matched by content, not path: by size and sampled content, and a file whose
    modification time changed by its whole sha256 against the one recorded when it was tokenized (where
    there is one). A run saved before stamps recorded each file's sha256: those are hashed now."""
    if not isinstance(saved, list) or not saved:
        return None  # a run saved before inputs were recorded
    old = [r for r in saved if isinstance(r, dict)]
    legacy = any("fingerprint" not in r for r in old)

    def key(r: dict[str, Any], current: bool) -> tuple[str, ...]:
        if not legacy:
            return str(r.get("role")), str(r.get("bytes")), str(r.get("fingerprint"))
        return str(r.get("role")), file_sha256(Path(r["path"])) if current else str(r.get("sha256"))

    old_keys = {key(r, False): r for r in old}
    new_keys = {key(r, True): r for r in now}
    gone = [str(r.get("path")) for k, r in old_keys.items() if k not in new_keys]
    added = [str(r["path"]) for k, r in new_keys.items() if k not in old_keys]
    if not legacy and len(old_keys) == len(old) and len(new_keys) == len(now):
        hashes = FileHashes(cache_root / "files")
        for k, r in new_keys.items():
            was = old_keys.get(k)
            if was is not None and was.get("mtime_ns") != r["mtime_ns"]:
                recorded = hashes.get({"size": was.get("bytes"), "mtime_ns": was.get("mtime_ns"),
                                       "fingerprint": was.get("fingerprint")})  # fmt: skip
                if recorded is not None and recorded != file_sha256(Path(r["path"])):
                    gone.append(str(r["path"]))
                    added.append(str(r["path"]))
    if not gone and not added and sorted(old_keys) == sorted(new_keys):
        return None
    return _named_changes(gone, added) or "the files' roles differ"


def _named_changes(gone: list[str], added: list[str]) -> str:
    """Recorded files whose text is not found now and files found now that were not recorded, by name: a
    path in both is one file whose text changed."""
    changed = [p for p in dict.fromkeys(gone) if p in added]
    groups = (
        ("changed", changed),
        ("changed or missing", [p for p in gone if p not in changed]),
        ("new", [p for p in added if p not in changed]),
    )
    return "; ".join(f"{what}: {', '.join(Path(p).name for p in paths)}" for what, paths in groups if paths)


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
    """Windows of block_size+1 tokens read in epochs (minigpt.data.order): each epoch reads every
    non-overlapping window of the split once, in an order and from an offset drawn from (seed, epoch), a
    batch the next batch_size of them on each rank.

    The state is the count of windows read (and whether the run follows the availability schedule of a
    corpus still being tokenized, `ramp`), the same on every rank: saving rank 0's state resumes every
    rank exactly, and rank r of world_size reads its own windows. Subclasses that draw rows at random
    (conversations, preference pairs, tasks) reseed `_gen` per batch from (seed, rank, batch) instead.
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
        self._check_enough(tokens, block_size)
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.batches = 0
        self.windows = 0  # windows read by every rank together (the epochs' position)
        self.ramp = ramp
        self._gen = torch.Generator()
        self._order: EpochOrder | None = None

    def _check_enough(self, tokens: Any, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise MinigptError(
                f"{len(tokens):,} tokens are too few for one window of block size {block_size} + 1; "
                f"use --block-size {max(len(tokens) - 1, 1)} or less, or give more text"
            )

    def _batch_seed(self, index: int) -> int:
        text = f"minigpt-batches:{self.seed}:{self.rank}:{index}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 CPU tensors of shape (batch_size, block_size), y shifted one token on."""
        if isinstance(self.tokens, GrowingStream):
            per_batch = self.batch_size * self.block_size * self.world_size
            length = self.tokens.length_for(self.batches, self.ramp, per_batch)
        else:
            length = len(self.tokens)
        self.batches += 1
        high = length - self.block_size  # starts in [0, high) keep the window in range
        order = self._order
        if order is None or (order.high, order.stride) != (high, self.block_size):  # a ramp moved either
            order = self._order = EpochOrder(high, self.block_size, self.seed)
        starts = order.starts(self.windows + self.rank * self.batch_size, self.batch_size)
        self.windows += self.batch_size * self.world_size
        return _window_batch(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        import torch

        return {
            "batches": torch.tensor([self.batches], dtype=torch.int64),
            "windows": torch.tensor([self.windows], dtype=torch.int64),
            "ramp": torch.tensor([int(self.ramp)], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        value = state.get("batches") if isinstance(state, dict) else None
        if value is None or value.numel() != 1 or int(value.item()) < 0:
            raise MinigptError("the saved batch sampler state is damaged (no batch count); start a new run")
        self.batches = int(value.item())
        windows = state.get("windows")
        if windows is None:  # a state saved before windows were read in epochs
            self.windows = self.batches * self.batch_size * self.world_size
        elif windows.numel() != 1 or not 0 <= int(windows.item()) < 2**62:
            raise MinigptError("the saved batch sampler state is damaged (window count); start a new run")
        else:
            self.windows = int(windows.item())
        ramp = state.get("ramp")  # absent in states saved before corpora were tokenized beside training
        self.ramp = ramp is not None and ramp.numel() == 1 and bool(ramp.item())


def eval_rows(
    count: int, batch_size: int, max_batches: int | None, rank: int = 0, world_size: int = 1
) -> Sequence[int]:
    """This rank's share of the rows (windows, conversations) an evaluation takes: all `count` of them, or
    max_batches x batch_size x world_size evenly spaced. Never all of them in memory: a large corpus's
    training split has tens of millions of windows, where an evaluation takes a few hundred.
    """
    rows: Sequence[int] = range(count)
    if max_batches is not None and max_batches * batch_size * world_size < count:
        wanted = max_batches * batch_size * world_size
        rows = np.unique(np.linspace(0, count - 1, wanted).round().astype(np.int64)).tolist()
    return rows[rank::world_size]


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
    mine = eval_rows((len(tokens) - 1) // block_size, batch_size, max_batches, rank, world_size)
    step = chunk or batch_size
    for i in range(0, len(mine), step):
        yield _window_batch(tokens, [w * block_size for w in mine[i : i + step]], block_size)
