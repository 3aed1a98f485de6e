"""Text files to token ids: input checks, a content-keyed token cache, train/val split and batches."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import math
import os
import re
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minigpt.dataconfig import (
    DEFAULT_BPE_VOCAB_SIZE,
    DataConfig,
    check_encoding,
)
from minigpt.errors import MinigptError, UsageError
from minigpt.files import read_bounded
from minigpt.tokenizer import (
    CharTokenizer,
    Tokenizer,
    build_tokenizer,
    default_threads,
    load_tokenizer_file,
    tokenizer_kind,
)

if TYPE_CHECKING:
    import torch

CACHE_FORMAT = 1  # bump when the token stream for the same text and tokenizer would change
READ_BYTES = 4 << 20  # bytes read and decoded at a time
PIECE_CHARS = 1 << 20  # characters per tokenizer call when encoding (one thread each)
TRAIN_PIECE_CHARS = 1 << 18  # characters per string handed to the BPE trainer (it buffers 64 of them)
SNIFF_BYTES = 8192  # a NUL byte this early means a binary file, as git decides
MAX_META_BYTES = 1 << 20  # a token cache entry's JSON is a few hundred bytes
# Python's UTF decoders never yield a lone surrogate; others can (utf-7, unicode_escape, punycode), so
# only their text is searched for one (a search that would cost time on every megabyte of the others)
_SURROGATE_FREE_CODECS = ("utf-8", "utf-16", "utf-32", "ascii", "iso8859-1")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# the temp files _Staging writes: .<final name>.<pid>@<host>.tmp
_TEMP_NAME = re.compile(r"\..+\.(?P<pid>\d{1,9})@(?P<host>[^@/]*)\.tmp")


@dataclass
class Dataset:
    """Token ids of the training and validation text, memory-mapped from the cache."""

    tokenizer: Tokenizer
    train: np.ndarray  # 1-D uint16/uint32 memmap of token ids
    val: np.ndarray
    val_bytes: int  # UTF-8 bytes of the validation text
    train_bytes: int
    cache_path: Path  # the training token file
    # each input file: absolute path, role (train or val), size and sha256, recorded so a resume can tell
    # whether the text changed and find it again after the run moved
    inputs: tuple[dict[str, Any], ...] = ()

    @property
    def val_bytes_per_token(self) -> float:
        """UTF-8 bytes per validation token: divide loss in bits/token by this to get bits/byte."""
        return self.val_bytes / len(self.val)


def text_size(n: int) -> str:
    """47 KB, 1.1 MB, 2.3 GB: a size a person reads at a glance (0.0 MB for 47 KB said nothing)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:,.0f} {unit}"
    return f"{n:,} bytes"


def bits_per_byte(loss_nats_per_token: float, tokens: int, num_bytes: int) -> float:
    """Convert a mean loss over `tokens` tokens that spell `num_bytes` bytes of text to bits per byte."""
    if tokens <= 0 or num_bytes <= 0:
        raise ValueError("bits_per_byte needs a positive token and byte count")
    return loss_nats_per_token * tokens / (num_bytes * math.log(2))


# ---------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class _Source:
    path: Path
    size: int
    digest: str  # sha256 of the bytes


def _collect_files(paths: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        try:
            files.extend(_files_at(p))
        except OSError as e:  # e.g. a name too long for the filesystem
            raise MinigptError(f"cannot access {p}: {e.strerror}") from None
    unique: dict[Path, Path] = {}
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def _files_at(p: Path) -> list[Path]:
    """The text file p, or the .txt files under the directory p (hidden ones left out)."""
    if p.is_dir():
        found = sorted(
            f
            for f in p.rglob("*.txt")
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not found:
            raise MinigptError(
                f"{p} is a directory with no .txt files; pass text files or a folder of .txt files"
            )
        return found
    if p.is_file():
        return [p]
    if p.exists():
        raise MinigptError(f"{p} is not a regular file; pass text files or directories of .txt files")
    raise MinigptError(f"{p}: no such file or directory")


def _ascii_compatible(encoding: str) -> bool:
    name = codecs.lookup(encoding).name
    return not name.startswith(("utf-16", "utf-32"))


def _binary_error(path: Path) -> MinigptError:
    return MinigptError(
        f"{path} looks like a binary file (it contains NUL bytes); minigpt trains on text files"
    )


def _hash_source(path: Path, encoding: str, advance: Callable[[int], None]) -> _Source:
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                if size == 0 and _ascii_compatible(encoding) and b"\x00" in block[:SNIFF_BYTES]:
                    raise _binary_error(path)
                h.update(block)
                size += len(block)
                advance(len(block))
    except OSError as e:
        raise MinigptError(f"cannot read {path}: {e.strerror}") from None
    if size == 0:
        raise MinigptError(f"{path} is empty: there is no text in it")
    return _Source(path, size, h.hexdigest())


def _file_text(src: _Source, encoding: str, errors: str, advance: Callable[[int], None]) -> Iterator[str]:
    """The decoded text of one file, block by block, checking it is real text as it goes."""
    decoder = codecs.getincrementaldecoder(encoding)(errors=errors)
    check_surrogates = not codecs.lookup(encoding).name.startswith(_SURROGATE_FREE_CODECS)
    offset = 0  # bytes of the file fed to the decoder so far
    nonblank = False
    with open(src.path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            final = not block
            state = decoder.getstate()
            pending = len(state[0]) if isinstance(state[0], bytes) else 0
            try:
                text = decoder.decode(block, final=final)
            except UnicodeDecodeError as e:
                where = offset - pending + e.start
                raise MinigptError(
                    f"{src.path}: invalid {encoding} at byte offset {where:,} ({e.reason}); fix the file, "
                    f"pass the right --encoding, or replace undecodable bytes with --encoding-errors replace"
                ) from None
            offset += len(block)
            if check_surrogates:
                text = _without_surrogates(text, src.path, encoding, errors)
            if text:
                if "\x00" in text:
                    raise _binary_error(src.path)
                nonblank = nonblank or not text.isspace()
                yield text
            advance(len(block))
            if final:
                break
    if not nonblank:
        raise MinigptError(f"{src.path} contains only whitespace: there is no text in it")


def _without_surrogates(text: str, path: Path, encoding: str, errors: str) -> str:
    """Text with its lone surrogates (not text: no tokenizer can encode one) treated as undecodable bytes
    are under `errors`: an error, U+FFFD or dropped."""
    found = _SURROGATE.search(text)
    if found is None:
        return text
    if errors == "strict":
        raise MinigptError(
            f"{path}: decoding it as {encoding} gives a lone surrogate (U+{ord(found.group()):04X}), "
            f"which is not text; fix the file, pass the right --encoding, or replace such characters with "
            f"--encoding-errors replace"
        )
    return _SURROGATE.sub("\ufffd" if errors == "replace" else "", text)


def read_text(paths: Iterable[Path], encoding: str = "utf-8", errors: str = "strict") -> str:
    """The whole text of files (or folders of .txt files), checked as training input is; files joined by newlines."""
    check_encoding(encoding)
    parts = []
    for path in _collect_files(Path(p) for p in paths):
        src = _hash_source(path, encoding, lambda n: None)
        parts.append("".join(_file_text(src, encoding, errors, lambda n: None)))
    return "\n".join(parts)


def _safe_cut(text: str, limit: int) -> int:
    """A cut point in (limit/2, limit] where every split pattern we use starts a new pre-token anyway,
    so encoding the pieces separately gives the same ids as encoding the whole text.
    """
    lo = limit // 2
    end = limit
    # after a newline that a letter or digit follows: no pattern joins "\n" to a following word
    while (i := text.rfind("\n", lo, end)) >= 0:
        if text[i + 1].isalnum():
            return i + 1
        end = i
    # else before the space of "word word": the space begins the next word's pre-token
    end = limit
    while (i := text.rfind(" ", lo, end)) > 0:
        if text[i - 1].isalpha() and text[i + 1].isalpha():
            return i
        end = i
    return limit  # no such point (one huge "word"): the split differs but still round-trips exactly


def _pieces(blocks: Iterable[str], size: int) -> Iterator[str]:
    buf = ""
    for block in blocks:
        buf = buf + block if buf else block
        while len(buf) > size:
            cut = _safe_cut(buf, size)
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


# ---------------------------------------------------------------------------------------------- cache


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _Staging:
    """Cache writes go to temp files and only land (by rename) once every check has passed;
    on failure the temp files and any directories this run created are removed: nothing is written.
    """

    def __init__(self) -> None:
        self.created: list[Path] = []
        self.moves: list[tuple[Path, Path]] = []

    def temp_for(self, final: Path) -> Path:
        for d in reversed([final.parent, *final.parent.parents]):
            if not d.exists():
                d.mkdir()
                self.created.append(d)
        tmp = final.with_name(f".{final.name}.{os.getpid()}@{_host()}.tmp")
        self.moves.append((tmp, final))
        return tmp

    def write_json(self, final: Path, obj: Any) -> None:
        self.temp_for(final).write_text(json.dumps(obj) + "\n", encoding="utf-8")

    def commit(self) -> None:
        # concurrent runs (torchrun ranks) write identical content; a rename is atomic, the last one wins
        for tmp, final in self.moves:
            os.replace(tmp, final)
        self.moves.clear()

    def abort(self) -> None:
        for tmp, _ in self.moves:
            with contextlib.suppress(OSError):
                tmp.unlink()
        for d in reversed(self.created):
            with contextlib.suppress(OSError):
                d.rmdir()


def _remove_stale_temps(directory: Path) -> None:
    """Delete the temp files of _Staging writers on this machine that were killed (kill -9, or SIGTERM
    while tokenizing). A file whose writer process is alive is never touched, nor one from another machine
    sharing the cache (an NFS home under multi-node torchrun), whose process table we cannot see.
    """
    for tmp in directory.glob(".*.tmp"):
        m = _TEMP_NAME.fullmatch(tmp.name)
        if m and m["host"] == _host() and not _process_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _host() -> str:
    """This machine's name as temp file names carry it (a name may hold any byte but NUL)."""
    return re.sub(r"[@/\\]", "_", socket.gethostname())


def _process_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows: assume alive, keep the file
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


class _PrepProgress:
    """Data preparation's progress bars and short notes on stderr, or silence."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def bar(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        if not self.enabled:
            yield lambda n: None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        console = Console(stderr=True)
        # a bar only makes sense on a terminal; in a log file it would leave blank lines behind
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task(description, total=total)
            yield lambda n: progress.advance(task, n)


def _texts(
    sources: Sequence[_Source], config: DataConfig, advance: Callable[[int], None], piece: int
) -> Iterator[str]:
    for src in sources:
        yield from _pieces(_file_text(src, config.encoding, config.errors, advance), piece)


def _get_tokenizer(
    config: DataConfig, sources: Sequence[_Source], staging: _Staging, report: _PrepProgress
) -> Tokenizer:
    kind = tokenizer_kind(config.tokenizer)
    if kind == "tiktoken":
        return build_tokenizer(config.tokenizer, None, None)
    vocab = (config.vocab_size or DEFAULT_BPE_VOCAB_SIZE) if kind == "bpe" else None
    key = _key(
        {
            "format": CACHE_FORMAT,
            "tokenizer": kind,
            "vocab_size": vocab,
            "encoding": config.encoding,
            "errors": config.errors,
            "inputs": [s.digest for s in sources],
        }
    )
    path = config.cache_root / "tokenizers" / f"{key}.json"
    if path.is_file():
        with contextlib.suppress(MinigptError):  # a damaged entry is built again
            tok = load_tokenizer_file(path)
            report.note(f"reusing the {tok.describe()} tokenizer built earlier from this text ({path})")
            return tok
    total = sum(s.size for s in sources)
    label = "building char vocabulary" if kind == "char" else f"training bpe tokenizer ({vocab:,} tokens)"
    start = time.perf_counter()
    with report.bar(label, total) as advance:
        tok = build_tokenizer(
            config.tokenizer, lambda: _texts(sources, config, advance, TRAIN_PIECE_CHARS), config.vocab_size
        )
    report.note(f"{label}: {tok.describe()} from {text_size(total)} in {time.perf_counter() - start:.1f}s")
    staging.write_json(path, tok.to_json())
    return tok


def _read_meta(meta_path: Path, bin_path: Path, vocab_size: int) -> dict[str, Any] | None:
    """A cache entry's meta if its token file is intact, else None (the entry is then rebuilt): the
    file's blake2b is the one recorded when it was written and every id is below vocab_size.
    """
    dtype = _token_dtype(vocab_size)
    try:
        meta = json.loads(read_bounded(meta_path, MAX_META_BYTES))
        if not _meta_fits(meta, bin_path, dtype):
            return None
        digest, top = _scan_tokens(bin_path, dtype)
    except (OSError, MinigptError, ValueError, RecursionError):  # unreadable, not JSON, or absurdly nested
        return None
    return meta if digest == meta["blake2b"] and top < vocab_size else None


def _meta_fits(meta: Any, bin_path: Path, dtype: np.dtype) -> bool:
    """The meta has every field, well typed, and the token file is a regular file of the size it says."""
    if not isinstance(meta, dict):
        return False
    tokens = meta.get("tokens")
    counts = (tokens, meta.get("text_bytes"))
    return (
        meta.get("format") == CACHE_FORMAT
        and meta.get("dtype") == dtype.name
        and isinstance(meta.get("blake2b"), str)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts)
        and bin_path.is_file()  # never open a FIFO planted in the cache
        and bin_path.stat().st_size == tokens * dtype.itemsize
    )


def _scan_tokens(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """blake2b of a token file and its largest id, in one pass of bounded memory."""
    h = hashlib.blake2b(digest_size=16)
    top = -1
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            h.update(block)
            ids = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
            top = max(top, int(ids.max(initial=0)))
    return h.hexdigest(), top


def _encode_stream(
    sources: Sequence[_Source],
    tokenizer: Tokenizer,
    config: DataConfig,
    out: Path,
    advance: Callable[[int], None],
    label: str,
) -> tuple[int, int]:
    """Tokenize the sources into `out` (documents joined by <|endoftext|> where the tokenizer has one).

    At most 2 pieces per thread are in memory at once, whatever the input size. Returns
    (tokens, UTF-8 bytes of text).
    """
    dtype = _token_dtype(tokenizer.vocab_size)
    lengths = tokenizer.text_byte_lengths()
    threads = default_threads()
    char = tokenizer if isinstance(tokenizer, CharTokenizer) else None
    unknown: dict[Path, set[str]] = {}
    tokens = text_bytes = 0

    def encode(piece: str) -> np.ndarray:
        return tokenizer.encode_arrays([piece], 1)[0]

    with open(out, "wb") as f, ThreadPoolExecutor(threads) as pool:
        pending: deque[Future[np.ndarray] | np.ndarray] = deque()

        def write_oldest() -> None:
            nonlocal tokens, text_bytes
            item = pending.popleft()
            ids = item.result() if isinstance(item, Future) else item
            ids.astype(dtype, copy=False).tofile(f)
            tokens += len(ids)
            text_bytes += int(lengths[ids].sum())

        try:
            for k, src in enumerate(sources):
                if k and tokenizer.eot_id is not None:
                    pending.append(np.array([tokenizer.eot_id], dtype=np.uint32))
                for piece in _pieces(_file_text(src, config.encoding, config.errors, advance), PIECE_CHARS):
                    if char is not None:
                        ids = char.lookup(piece)
                        if (ids < 0).any():
                            unknown.setdefault(src.path, set()).update(char.unknown_chars(piece))
                        if not unknown:  # else keep scanning only to list every unknown character at once
                            pending.append(ids)
                    else:
                        pending.append(pool.submit(encode, piece))
                    while len(pending) > 2 * threads:
                        write_oldest()
            while pending and not unknown:
                write_oldest()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if unknown:
        files = list(unknown)
        where = f"{label} file {files[0]}" + (f" (and {len(files) - 1} more)" if len(files) > 1 else "")
        raise MinigptError(CharTokenizer.unknown_message(set().union(*unknown.values()), where))
    return tokens, text_bytes


def _get_tokens(
    sources: Sequence[_Source],
    tokenizer: Tokenizer,
    tokenizer_digest: str,
    config: DataConfig,
    staging: _Staging,
    report: _PrepProgress,
    label: str,
) -> tuple[Path, dict[str, Any]]:
    key = _key(
        {
            "format": CACHE_FORMAT,
            "tokenizer": tokenizer_digest,
            "encoding": config.encoding,
            "errors": config.errors,
            "inputs": [s.digest for s in sources],
        }
    )
    bin_path = config.cache_root / "tokens" / f"{key}.bin"
    meta_path = bin_path.with_suffix(".json")
    meta = _read_meta(meta_path, bin_path, tokenizer.vocab_size)
    if meta is not None:
        report.note(f"reusing cached {label} tokens: {meta['tokens']:,} tokens ({bin_path})")
        return bin_path, meta
    if meta_path.exists() or bin_path.exists():
        report.note(
            f"cached {label} tokens {bin_path} fail their check (damaged, incomplete or from an older "
            f"minigpt): tokenizing again"
        )
    total = sum(s.size for s in sources)
    start = time.perf_counter()
    tmp = staging.temp_for(bin_path)
    with report.bar(f"tokenizing {label} text", total) as advance:
        tokens, text_bytes = _encode_stream(sources, tokenizer, config, tmp, advance, label)
    seconds = time.perf_counter() - start
    dtype = _token_dtype(tokenizer.vocab_size)
    meta = {
        "format": CACHE_FORMAT,
        "tokens": tokens,
        "dtype": dtype.name,
        "blake2b": _scan_tokens(tmp, dtype)[0],
        "text_bytes": text_bytes,
        "tokenizer": tokenizer.describe(),
        "inputs": [str(s.path) for s in sources],
    }
    staging.write_json(meta_path, meta)
    report.note(
        f"tokenized {label} text: {text_size(total)} -> {tokens:,} tokens in {seconds:.1f}s "
        f"({total / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
    )
    return bin_path, meta


def _count_bytes(tokens: np.ndarray, lengths: np.ndarray, step: int = 1 << 22) -> int:
    # in slices, so a huge memmap is never copied whole into memory
    return sum(int(lengths[tokens[i : i + step]].sum()) for i in range(0, len(tokens), step))


def prepare_data(
    config: DataConfig, block_size: int, tokenizer: Tokenizer | None = None, progress: bool = True
) -> Dataset:
    """Check the inputs, build the tokenizer (or use the one given, e.g. on resume or fine-tuning),
    tokenize once into the cache (keyed by the content hash of the inputs and the tokenizer), memory-map
    the tokens and split them. Every bad input is a one-line MinigptError, and then nothing is written.

    Cache layout: <cache>/tokenizers/<key>.json (trained char/bpe tokenizers) and <cache>/tokens/<key>.bin
    (raw uint16/uint32 ids) with <key>.json beside it (count, dtype, text bytes); entries are never evicted.
    Concurrent calls are safe (atomic renames) but each tokenizes on a cold cache: under torchrun, prepare
    on rank 0 first, then the other ranks reuse the cache.

    With --val-fraction the tokenizer learns from all the input text; with --val-file from the training
    files only, and a char tokenizer then rejects validation characters it never saw.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UsageError(f"--block-size must be a positive integer, not {block_size!r}")
    report = _PrepProgress(progress)
    train_files = _collect_files(config.paths)
    val_files = _collect_files([config.val_file]) if config.val_file is not None else []
    both = {f.resolve() for f in train_files} & {f.resolve() for f in val_files}
    if both:
        raise UsageError(f"{next(iter(both))} is both training and validation text; pick one or the other")
    total = sum(f.stat().st_size for f in train_files + val_files)
    with (
        report.bar("hashing inputs", total)
        if total > 64 << 20
        else contextlib.nullcontext(lambda n: None) as adv
    ):
        train_src = [_hash_source(f, config.encoding, adv) for f in train_files]
        val_src = [_hash_source(f, config.encoding, adv) for f in val_files]

    for part in ("tokenizers", "tokens"):
        _remove_stale_temps(config.cache_root / part)
    staging = _Staging()
    try:
        if tokenizer is None:
            tokenizer = _get_tokenizer(config, train_src, staging, report)
        digest = hashlib.sha256(json.dumps(tokenizer.to_json(), sort_keys=True).encode()).hexdigest()
        train_bin, train_meta = _get_tokens(train_src, tokenizer, digest, config, staging, report, "training")
        val_bin, val_meta = train_bin, train_meta
        if val_src:
            val_bin, val_meta = _get_tokens(val_src, tokenizer, digest, config, staging, report, "validation")
        n = int(train_meta["tokens"])
        if val_src:
            n_train, n_val = n, int(val_meta["tokens"])
        else:
            n_val = max(1, round(n * config.val_fraction))
            n_train = n - n_val
        _check_long_enough(config, block_size, n_train, n_val)
        staging.commit()
    except OSError as e:  # unreadable input, unwritable cache, full disk
        staging.abort()
        where = Path(e.filename) if e.filename else config.cache_root
        hint = "set MINIGPT_CACHE_DIR to a writable folder with free space"
        fix = f"; {hint}" if config.cache_root in (where, *where.parents) else ""
        raise MinigptError(f"cannot access {where}: {e.strerror or e}{fix}") from None
    except BaseException:
        staging.abort()
        raise

    dtype = np.dtype(train_meta["dtype"])
    stream = np.memmap(train_bin, dtype=dtype, mode="r", shape=(n,))
    lengths = tokenizer.text_byte_lengths()
    if val_src:
        train = stream
        val = np.memmap(val_bin, dtype=dtype, mode="r", shape=(n_val,))
        val_bytes, train_bytes = int(val_meta["text_bytes"]), int(train_meta["text_bytes"])
    else:
        train, val = stream[:n_train], stream[n_train:]
        val_bytes = _count_bytes(val, lengths)
        train_bytes = int(train_meta["text_bytes"]) - val_bytes
    inputs = tuple(_input_record(src, "train") for src in train_src) + tuple(
        _input_record(s, "val") for s in val_src
    )
    return Dataset(tokenizer, train, val, val_bytes, train_bytes, train_bin, inputs)


def _input_record(src: _Source, role: str) -> dict[str, Any]:
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


def _check_long_enough(config: DataConfig, block_size: int, n_train: int, n_val: int) -> None:
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

    Reseeding per batch makes the state just the number of batches drawn, the same on every rank:
    saving rank 0's state resumes every rank exactly, and rank r of world_size draws its own windows.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
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
        self._gen = torch.Generator()

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
        import torch

        self._gen.manual_seed(self._batch_seed(self.batches))
        self.batches += 1
        high = len(self.tokens) - self.block_size  # starts in [0, high) keep the window in range
        starts = torch.randint(0, high, (self.batch_size,), generator=self._gen).tolist()
        return _window_batch(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        import torch

        return {"batches": torch.tensor([self.batches], dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        value = state.get("batches") if isinstance(state, dict) else None
        if value is None or value.numel() != 1 or int(value.item()) < 0:
            raise MinigptError("the saved batch sampler state is damaged (no batch count); start a new run")
        self.batches = int(value.item())


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
