"""Data pipeline: streaming tokenization into the cache, splits, batches, and every bad input."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import minigpt.corpus.encode as encode
import minigpt.corpus.ingest as ingest
import minigpt.corpus.readers as readers
import minigpt.data.dataset as data
from minigpt.corpus.store import token_dtype
from minigpt.data.dataset import (
    BatchSampler,
    DataConfig,
    bits_per_byte,
    eval_batches,
    eval_rows,
    prepare_data,
)
from minigpt.data.order import EpochOrder, Shuffle
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.bpe import BPETokenizer
from minigpt.tokenizer.char import CharTokenizer
from minigpt.tokenizer.load import build_tokenizer

WORDS = "the king and queen of england spoke to a citizen about bread corn and the senate".split()


def make_text(n_words: int = 3000, seed: int = 0, newlines: bool = True) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(n_words):
        out.append(rng.choice(WORDS))
        out.append("\n" if newlines and i % 9 == 8 else (", " if i % 13 == 0 else " "))
    return "".join(out).strip() + "\n"


def config(tmp_path: Path, *paths: Path, **kw) -> DataConfig:
    kw.setdefault("cache_dir", tmp_path / "cache")
    kw.setdefault("tokenizer", "char")  # most tests here are about the pipeline, not the default tokenizer
    return DataConfig(paths=tuple(paths), **kw)


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts real tokenizations (files) and tokenizer builds (cache misses)."""
    calls = {"encode": 0, "build": 0}
    encode, build = ingest.tokenize_file, data.build_tokenizer

    def counting_encode(*args, **kwargs):
        calls["encode"] += 1
        return encode(*args, **kwargs)

    def counting_build(*args, **kwargs):
        calls["build"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(ingest, "tokenize_file", counting_encode)
    monkeypatch.setattr(data, "build_tokenizer", counting_build)
    return calls


# ---------------------------------------------------------------------------------------------- basics


def test_char_dataset_split_and_bytes(tmp_path: Path) -> None:
    text = make_text() + "café ☕\n"
    ds = prepare_data(config(tmp_path, write(tmp_path / "a.txt", text)), 16, progress=False)
    assert isinstance(ds.tokenizer, CharTokenizer) and set(ds.tokenizer.chars) == set(text)
    assert ds.train[:].dtype == np.uint16 and ds.complete
    assert ds.tokenizer.decode(all_ids(ds)) == text  # validation is the end of the corpus
    # one document: the cut falls inside it, at the first character of its last 10% of bytes
    budget = round(len(text.encode()) * 0.1)
    assert budget - 4 < ds.val_bytes <= budget
    assert ds.val_bytes == len(ds.tokenizer.decode(ds.val[:].tolist()).encode())
    assert ds.val_bytes_per_token == ds.val_bytes / len(ds.val)
    assert ds.store == tmp_path / "cache" / "tokens" and any(ds.store.glob("*/chunk-000000.bin"))


def test_bpe_dataset_matches_whole_text_encoding(tmp_path: Path) -> None:
    text = make_text(5000)
    ds = prepare_data(
        config(tmp_path, write(tmp_path / "a.txt", text), tokenizer="bpe", vocab_size=300), 32, progress=False
    )
    assert isinstance(ds.tokenizer, BPETokenizer) and ds.tokenizer.vocab_size == 300
    # the document ends with the end-of-text token
    assert all_ids(ds) == ds.tokenizer.encode(text) + [ds.tokenizer.eot_id]


@pytest.mark.slow
@pytest.mark.parametrize("newlines", [True, False])
@pytest.mark.parametrize("kind", ["bpe", "r50k"])
def test_chunked_encoding_equals_whole_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, r50k_file: Path, kind: str, newlines: bool
) -> None:
    """Pieces are cut where the split pattern starts a new pre-token anyway, so ids do not change."""
    monkeypatch.setattr(readers, "READ_BYTES", 777)
    monkeypatch.setattr(encode, "PIECE_CHARS", 1000)
    text = make_text(4000, newlines=newlines) + "\n\n  indented line\n\tand tabs\n" + make_text(500, seed=1)
    spec = str(r50k_file) if kind == "r50k" else "bpe"
    vocab = 300 if kind == "bpe" else None
    ds = prepare_data(
        config(tmp_path, write(tmp_path / "a.txt", text), tokenizer=spec, vocab_size=vocab), 8, progress=False
    )
    assert all_ids(ds) == ds.tokenizer.encode(text) + [ds.tokenizer.eot_id]


def all_ids(ds: data.Dataset) -> list[int]:
    """A one-file corpus's ids: its training part, then its end (validation)."""
    return np.concatenate([ds.train[:], ds.val[:]]).tolist()


@pytest.mark.slow
def test_shakespeare_r50k_tokens(tmp_path: Path, shakespeare: Path, r50k_file: Path) -> None:
    ds = prepare_data(config(tmp_path, shakespeare, tokenizer=str(r50k_file)), 256, progress=False)
    text = shakespeare.read_text(encoding="utf-8")
    assert len(ds.train) + len(ds.val) == 338_025 + 1  # tiktoken r50k_base on tinyshakespeare, and eot
    assert all_ids(ds) == ds.tokenizer.encode(text) + [50256]


def test_directory_and_several_files(tmp_path: Path) -> None:
    write(tmp_path / "docs" / "b.txt", "second file\n")
    write(tmp_path / "docs" / "a.txt", "first file\n")
    write(tmp_path / "docs" / "sub" / "c.txt", "third file\n")
    write(tmp_path / "docs" / "notes.md", "not text for us\n")
    write(tmp_path / "docs" / ".hidden" / "d.txt", "hidden\n")
    extra = write(tmp_path / "extra.txt", make_text(300))
    ds = prepare_data(
        config(tmp_path, tmp_path / "docs", extra, tokenizer="bpe", vocab_size=280), 4, progress=False
    )
    tok, eot = ds.tokenizer, "<|endoftext|>"
    extra_text = make_text(300)
    # validation is the corpus's end: the last 10% of the corpus lies inside its last file, extra.txt, so
    # the cut falls inside it; it ends with end-of-text
    val_text = tok.decode(ds.val[:].tolist())
    tail = val_text.removesuffix(eot)
    assert val_text.endswith(eot) and extra_text.endswith(tail) and 0 < len(tail) < len(extra_text) // 5
    # training: the other files (notes.md and .hidden left out), each a document ending with end-of-text,
    # and the start of extra.txt
    head = extra_text[: len(extra_text) - len(tail)]
    rest = tok.decode(ds.train[:].tolist()).replace(head, "", 1)
    assert rest.endswith(eot)
    assert sorted(rest.split(eot)[:-1]) == ["first file\n", "second file\n", "third file\n"]
    # eot is not text: it adds no bytes
    assert ds.val_bytes == len(tail.encode())


def test_val_file(tmp_path: Path) -> None:
    train, val = (
        write(tmp_path / "train.txt", make_text(2000)),
        write(tmp_path / "val.txt", make_text(500, seed=3)),
    )
    ds = prepare_data(config(tmp_path, train, val_file=val), 16, progress=False)
    assert ds.tokenizer.decode(ds.train[:].tolist()) == train.read_text()
    assert ds.tokenizer.decode(ds.val[:].tolist()) == val.read_text()
    assert ds.val_bytes == len(val.read_bytes())


def test_given_tokenizer_is_used(tmp_path: Path, counted: dict[str, int]) -> None:
    tok = CharTokenizer.from_texts([make_text()])
    ds = prepare_data(
        config(tmp_path, write(tmp_path / "a.txt", make_text(seed=5))), 8, tokenizer=tok, progress=False
    )
    assert ds.tokenizer is tok and counted["build"] == 0


def test_encoding_option_and_replacement(tmp_path: Path) -> None:
    latin = write(tmp_path / "latin.txt", ("café crème " * 50).encode("latin-1"))
    ds = prepare_data(config(tmp_path, latin, encoding="latin-1"), 8, progress=False)
    assert "é" in ds.tokenizer.chars
    bad = write(tmp_path / "bad.txt", b"good text " * 30 + b"\xff\xfe" + b" more text" * 30)
    ds = prepare_data(config(tmp_path, bad, errors="replace"), 8, progress=False)
    assert "\ufffd" in ds.tokenizer.chars


@pytest.mark.parametrize("encoding", ["bogus", "base64", "hex", "zlib", "rot13", "uu", "undefined"])
def test_encoding_must_decode_bytes_to_text(encoding: str) -> None:
    with pytest.raises(UsageError, match=f"--encoding '{encoding}'") as e:
        DataConfig(paths=(Path("a.txt"),), encoding=encoding)
    assert "\n" not in str(e.value) and "utf-8" in str(e.value)


@pytest.mark.parametrize("encoding, raw", [("unicode_escape", b"\\ud800"), ("utf-7", b"+2AA-")])
def test_lone_surrogates_a_decoder_yields_follow_encoding_errors(
    tmp_path: Path, encoding: str, raw: bytes
) -> None:
    path = write(tmp_path / "a.txt", b"plain words and " * 40 + raw + b" more words" * 40)
    with pytest.raises(MinigptError, match=f"{path}: decoding it as {encoding} gives a lone surrogate") as e:
        prepare_data(config(tmp_path, path, encoding=encoding), 8, progress=False)
    assert_one_line_and_nothing_written(e, tmp_path)
    replaced = prepare_data(config(tmp_path, path, encoding=encoding, errors="replace"), 8, progress=False)
    assert "\ufffd" in replaced.tokenizer.chars
    dropped = prepare_data(config(tmp_path, path, encoding=encoding, errors="ignore"), 8, progress=False)
    assert set(dropped.tokenizer.chars) == set("plain words and more")
    bpe = prepare_data(
        config(tmp_path, path, encoding=encoding, errors="replace", tokenizer="bpe"), 8, progress=False
    )
    assert bpe.tokenizer.decode(all_ids(bpe)).count("\ufffd") == 1


# ---------------------------------------------------------------------------------------------- cache


def test_cache_is_reused_then_invalidated(
    tmp_path: Path, counted: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "a.txt", make_text(2000))
    cfg = config(tmp_path, path, tokenizer="bpe", vocab_size=300)
    first = prepare_data(cfg, 16, progress=False)
    assert counted == {"encode": 2, "build": 1}  # the file's start (training) and its end (validation)
    second = prepare_data(cfg, 16, progress=True)
    assert counted == {"encode": 2, "build": 1}  # neither trained nor tokenized again
    err = capsys.readouterr().err
    assert "reusing the tokens of 1 file(s)" in err and "reusing the bpe" in err
    assert all_ids(second) == all_ids(first) and second.tokenizer.to_json() == first.tokenizer.to_json()

    # a different block size reuses the same tokens; a different split cuts the file elsewhere, so its two
    # spans are tokenized again (the tokenizer is kept)
    prepare_data(config(tmp_path, path, tokenizer="bpe", vocab_size=300), 8, progress=False)
    assert counted == {"encode": 2, "build": 1}
    prepare_data(config(tmp_path, path, tokenizer="bpe", vocab_size=300, val_fraction=0.2), 8, progress=False)
    assert counted == {"encode": 4, "build": 1}

    write(path, make_text(2000, seed=9))
    third = prepare_data(cfg, 16, progress=False)
    assert counted == {"encode": 6, "build": 2}
    assert third.tokenizer.decode(all_ids(third)[:-1]) == path.read_text()


def test_cache_keyed_by_tokenizer(tmp_path: Path, counted: dict[str, int]) -> None:
    path = write(tmp_path / "a.txt", make_text(2000))
    for kw in (dict(tokenizer="bpe", vocab_size=300), dict(tokenizer="bpe", vocab_size=320), {}):
        prepare_data(config(tmp_path, path, **kw), 16, progress=False)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 6 and counted["encode"] == 6


def chunk_files(tmp_path: Path) -> tuple[Path, Path]:
    """The first chunk of the one-file corpus's training span (the larger of its two entries)."""
    bin_path = max((tmp_path / "cache" / "tokens").glob("*/chunk-000000.bin"), key=lambda p: p.stat().st_size)
    return bin_path, bin_path.with_suffix(".json")


def test_damaged_cache_is_rebuilt(tmp_path: Path, counted: dict[str, int]) -> None:
    cfg = config(tmp_path, write(tmp_path / "a.txt", make_text(2000)))
    expected = all_ids(prepare_data(cfg, 16, progress=False))
    bin_path, _ = chunk_files(tmp_path)
    with open(bin_path, "r+b") as f:
        f.truncate(100)  # e.g. a crash or a full disk
    again = prepare_data(cfg, 16, progress=False)
    assert counted["encode"] == 3 and all_ids(again) == expected


def test_same_size_garbage_cache_is_rebuilt(tmp_path: Path, counted: dict[str, int]) -> None:
    cfg = config(tmp_path, write(tmp_path / "a.txt", make_text(2000)))
    expected = all_ids(prepare_data(cfg, 16, progress=False))
    bin_path, _ = chunk_files(tmp_path)
    bin_path.write_bytes(np.random.default_rng(0).bytes(bin_path.stat().st_size))
    again = prepare_data(cfg, 16, progress=False)
    assert counted["encode"] == 3 and all_ids(again) == expected


def test_cache_with_ids_past_the_vocabulary_is_rebuilt(tmp_path: Path, counted: dict[str, int]) -> None:
    """Even with a checksum that matches (written by hand), ids the tokenizer lacks are never used."""
    import zlib

    cfg = config(tmp_path, write(tmp_path / "a.txt", make_text(2000)))
    vocab = prepare_data(cfg, 16, progress=False).tokenizer.vocab_size
    bin_path, meta_path = chunk_files(tmp_path)
    tokens = np.fromfile(bin_path, dtype=np.uint16)
    tokens[5] = vocab
    tokens.tofile(bin_path)
    meta = json.loads(meta_path.read_text())
    meta["crc32"] = zlib.crc32(bin_path.read_bytes())
    meta_path.write_text(json.dumps(meta))
    again = prepare_data(cfg, 16, progress=False)
    assert counted["encode"] == 3 and max(all_ids(again)) < vocab


@pytest.mark.parametrize(
    "damage",
    [
        {"tokens": "many"},
        {"tokens": True},
        {"dtype": "object"},
        {"text_bytes": -1},
        {"crc32": None},
        {"format": 0},
    ],
)
def test_cache_meta_with_bad_fields_is_rebuilt(
    tmp_path: Path, counted: dict[str, int], damage: dict[str, object]
) -> None:
    cfg = config(tmp_path, write(tmp_path / "a.txt", make_text(2000)))
    prepare_data(cfg, 16, progress=False)
    _, meta_path = chunk_files(tmp_path)
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | damage))
    prepare_data(cfg, 16, progress=False)
    assert counted["encode"] == 3


@pytest.mark.parametrize("planted", ["bin", "meta", "done"])
def test_fifo_in_the_cache_is_never_opened(tmp_path: Path, counted: dict[str, int], planted: str) -> None:
    cfg = config(tmp_path, write(tmp_path / "a.txt", make_text(2000)))
    prepare_data(cfg, 16, progress=False)
    bin_path, meta_path = chunk_files(tmp_path)
    if planted == "bin":  # with a meta whose size check a FIFO (size 0) passes
        meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"tokens": 0}))
    fifo = {"bin": bin_path, "meta": meta_path, "done": bin_path.parent / "done.json"}[planted]
    fifo.unlink()
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    prepare_data(cfg, 16, progress=False)
    assert counted["encode"] == 3 and fifo.is_file()


def test_stale_temp_files_of_dead_writers_on_this_machine_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tokens = tmp_path / "cache" / "tokens" / "entry"
    host = socket.gethostname()
    names = {
        "dead": f".chunk-000000.bin.{dead.pid}@{host}.tmp",
        "alive": f".chunk-000000.bin.{os.getpid()}@{host}.tmp",  # a concurrent writer: this process
        "elsewhere": f".chunk-000000.json.{dead.pid}@another-host.tmp",  # can't tell: may be running
        "not ours": ".notes.tmp",
    }
    for name in names.values():
        write(tokens / name, "partial")
    prepare_data(config(tmp_path, write(tmp_path / "a.txt", make_text(2000))), 16, progress=False)
    assert sorted(p.name for p in tokens.glob(".*")) == sorted(v for k, v in names.items() if k != "dead")


def test_progress_messages_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prepare_data(config(tmp_path, write(tmp_path / "a.txt", make_text()), tokenizer="bpe", vocab_size=300), 8)
    out, err = capsys.readouterr()
    assert out == "" and "tokenized 1 file(s)" in err and "training bpe tokenizer" in err
    prepare_data(config(tmp_path, write(tmp_path / "b.txt", make_text(seed=2))), 8, progress=False)
    assert capsys.readouterr() == ("", "")


# ---------------------------------------------------------------------------------------------- bad input


def assert_one_line(exc: pytest.ExceptionInfo) -> None:
    assert isinstance(exc.value, MinigptError) and exc.value.exit_code != 0
    assert "\n" not in str(exc.value)


def assert_one_line_and_nothing_written(exc: pytest.ExceptionInfo, tmp_path: Path) -> None:
    assert_one_line(exc)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.txt", b"", "is empty"),
        ("blank.txt", b" \n\t\r\n   \n", "only whitespace"),
        ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "looks like a binary file"),
        ("nul.txt", b"text " * 5000 + b"\x00" + b"text", "looks like a binary file"),
    ],
)
def test_bad_file_content(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    path = write(tmp_path / name, content)
    with pytest.raises(MinigptError, match=match) as e:
        prepare_data(config(tmp_path, path), 8, progress=False)
    assert str(path) in str(e.value)
    assert_one_line_and_nothing_written(e, tmp_path)


@pytest.mark.parametrize("read_bytes", [readers.READ_BYTES, 1000, 1001, 1002])
def test_invalid_utf8_names_file_and_byte_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_bytes: int
) -> None:
    monkeypatch.setattr(readers, "READ_BYTES", read_bytes)
    good = "é".encode() * 500  # 1000 bytes of two-byte characters
    path = write(
        tmp_path / "a.txt", good + b"\xc3" + b"(" + b"more" * 100
    )  # \xc3 must be followed by 0x80-0xbf
    with pytest.raises(MinigptError, match=r"a\.txt: invalid utf-8 at byte offset 1,000 ") as e:
        prepare_data(config(tmp_path, path, tokenizer="bpe", vocab_size=260), 8, progress=False)
    assert "--encoding" in str(e.value)
    assert_one_line_and_nothing_written(e, tmp_path)


def test_truncated_utf8_at_end_of_file(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", b"abc " * 100 + "é".encode()[:1])
    with pytest.raises(MinigptError, match="byte offset 400 ") as e:
        prepare_data(config(tmp_path, path), 8, progress=False)
    assert_one_line_and_nothing_written(e, tmp_path)


def test_missing_path_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(MinigptError, match="no such file or directory") as e:
        prepare_data(config(tmp_path, tmp_path / "nope.txt"), 8, progress=False)
    assert_one_line_and_nothing_written(e, tmp_path)
    write(tmp_path / "dir" / "readme.md", "not a .txt")
    with pytest.raises(MinigptError, match="directory with no corpus files") as e:
        prepare_data(config(tmp_path, tmp_path / "dir"), 8, progress=False)
    assert_one_line_and_nothing_written(e, tmp_path)
    with pytest.raises(MinigptError, match="no such file") as e:
        prepare_data(
            config(tmp_path, write(tmp_path / "ok.txt", make_text()), val_file=tmp_path / "v.txt"), 8
        )
    assert_one_line_and_nothing_written(e, tmp_path)


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_too_short_says_tokens_and_fitting_block_size(tmp_path: Path, tokenizer: str) -> None:
    path = write(tmp_path / "a.txt", make_text(40))
    vocab = 300 if tokenizer == "bpe" else None
    ds = prepare_data(config(tmp_path / "ok", path, tokenizer=tokenizer, vocab_size=vocab), 1, progress=False)
    n = len(ds.train) + len(ds.val)
    n_val = len(ds.val)
    with pytest.raises(MinigptError) as e:
        prepare_data(config(tmp_path, path, tokenizer=tokenizer, vocab_size=vocab), 256, progress=False)
    message = str(e.value)
    assert f"only {n:,} tokens" in message and "--block-size 256" in message
    assert (f"--block-size {n_val - 1} or less" in message) if n_val > 1 else ("give more text" in message)
    assert_one_line(e)  # the good text's tokens may stay in the store


def test_too_short_with_val_file(tmp_path: Path) -> None:
    train = write(tmp_path / "train.txt", make_text(200))
    val = write(tmp_path / "val.txt", "the king\n")
    with pytest.raises(MinigptError, match=r"validation file 9: .*--block-size 8 or less") as e:
        prepare_data(config(tmp_path, train, val_file=val), 64, progress=False)
    assert_one_line(e)  # the good text's tokens may stay in the store


def test_char_val_file_with_unseen_characters(tmp_path: Path) -> None:
    train = write(tmp_path / "train.txt", make_text(500))
    val = write(tmp_path / "val.txt", "the king Zé said 42\n")
    with pytest.raises(MinigptError) as e:
        prepare_data(config(tmp_path, train, val_file=val), 4, progress=False)
    message = str(e.value)
    assert f"validation file {val} has 4 character(s)" in message
    for c in ("'2'", "'4'", "'Z'", "'é'"):
        assert c in message
    assert "--tokenizer bpe" in message
    assert_one_line(e)  # the char vocabulary of the training text stays cached, no tokens do
    assert not (tmp_path / "cache" / "tokens").exists()


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", make_text())
    cases = [
        dict(tokenizer="bpe", vocab_size=200),
        dict(tokenizer="bpe", vocab_size=256),
        dict(tokenizer="char", vocab_size=300),
        dict(tokenizer="wordpiece"),
        dict(val_fraction=0.0),
        dict(val_fraction=1.0),
        dict(encoding="klingon"),
        dict(errors="surrogateescape"),
    ]
    for kw in cases:
        with pytest.raises(UsageError) as e:
            config(tmp_path, path, **kw)
        assert "\n" not in str(e.value), kw
    with pytest.raises(UsageError, match="at least 257"):
        config(tmp_path, path, tokenizer="bpe", vocab_size=255)
    with pytest.raises(UsageError, match="no training text"):
        DataConfig(paths=())
    with pytest.raises(UsageError, match="block-size"):
        prepare_data(config(tmp_path, path), 0, progress=False)
    with pytest.raises(UsageError, match="both training and validation"):
        prepare_data(config(tmp_path, path, val_file=path), 8, progress=False)
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------- batches


def test_batches_are_windows_of_the_stream() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = BatchSampler(tokens, block_size=16, batch_size=8, seed=0).next_batch()
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))  # consecutive tokens
    assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_batches_deterministic_per_seed_and_rank() -> None:
    tokens = np.arange(100_000, dtype=np.uint32)

    def draws(seed: int, rank: int = 0, world: int = 1, n: int = 3) -> list[torch.Tensor]:
        sampler = BatchSampler(tokens, 32, 4, seed=seed, rank=rank, world_size=world)
        return [sampler.next_batch()[0] for _ in range(n)]

    a, b = draws(1), draws(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(draws(2)[0], a[0])
    ranks = [draws(1, r, 4)[0][:, 0] for r in range(4)]
    starts = [set(r.tolist()) for r in ranks]
    assert all(not (starts[i] & starts[j]) for i in range(4) for j in range(i + 1, 4))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_a_shuffle_is_a_permutation_fixed_by_its_key(n: int) -> None:
    every = np.arange(n)
    a, b, other = Shuffle(n, 5)(every), Shuffle(n, 5)(every[::-1])[::-1], Shuffle(n, 6)(every)
    assert sorted(a.tolist()) == every.tolist() and a.dtype == np.int64
    assert a.tolist() == b.tolist()  # image by image, in any order
    assert n < 7 or a.tolist() != other.tolist() and a.tolist() != every.tolist()
    with pytest.raises(IndexError):
        Shuffle(n, 5)(np.array([n]))


def test_each_epoch_reads_every_window_once_from_its_own_offset() -> None:
    high, stride = 1000, 16  # 62 windows an epoch, the last ending before high
    order = EpochOrder(high, stride, seed=3)
    epochs = [order.starts(e * order.per_epoch, order.per_epoch) for e in range(4)]
    for starts in epochs:
        offset = min(starts)
        assert sorted(starts) == [offset + stride * k for k in range(62)] and max(starts) < high
    assert len({tuple(s) for s in epochs}) == 4 and len({min(s) for s in epochs}) > 1
    # any split of the run into calls gives the same windows
    assert order.starts(50, 30) == epochs[0][50:] + epochs[1][:18]
    short = EpochOrder(5, 16, seed=1).starts(0, 20)  # one window an epoch, each from its own offset
    assert all(0 <= s < 5 for s in short) and len(set(short)) > 1


def test_batches_read_the_text_in_epochs_across_ranks_and_a_batch_ramp() -> None:
    """Every window of an epoch once, none twice, whatever the batch size on the way and however the
    ranks share it out; where random windows with replacement repeat some before reading others."""
    tokens = np.arange(16 * 41 + 1, dtype=np.uint32)  # 40 windows of 16 an epoch (starts below 641)
    single, ranks = (
        BatchSampler(tokens, 16, 8, seed=2),
        [BatchSampler(tokens, 16, 4, 2, r, 2) for r in (0, 1)],
    )
    firsts = [single.next_batch()[0][:, 0] for _ in range(5)]
    assert torch.equal(
        torch.cat(firsts), torch.cat([r.next_batch()[0][:, 0] for _ in range(5) for r in ranks])
    )
    ramped = BatchSampler(tokens, 16, 2, seed=2)
    starts = []
    for size in (2, 2, 6, 10, 20):
        ramped.batch_size = size
        starts += ramped.next_batch()[0][:, 0].tolist()
    assert starts == torch.cat(firsts).tolist()
    assert len(set(starts)) == 40 and len({s % 16 for s in starts}) == 1


def test_sampler_state_replays_exactly() -> None:
    tokens = np.arange(50_000, dtype=np.uint16)
    sampler = BatchSampler(tokens, 8, 4, seed=7)
    for _ in range(5):
        sampler.next_batch()
    state = {k: v.clone() for k, v in sampler.state_dict().items()}
    expected = [sampler.next_batch() for _ in range(3)]
    resumed = BatchSampler(tokens, 8, 4, seed=7)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip([resumed.next_batch() for _ in range(3)], expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(MinigptError, match="damaged"):
        resumed.load_state_dict({})
    for windows in (-1, 2**62):  # a stranger's run folder: never a count that overflows the order's numbers
        with pytest.raises(MinigptError, match="damaged"):
            resumed.load_state_dict({**state, "windows": torch.tensor([windows])})
    before = {k: v for k, v in state.items() if k != "windows"}  # saved before epochs: counted from batches
    resumed.load_state_dict(before)
    assert resumed.windows == 5 * 4


def test_sampler_state_goes_through_safetensors(tmp_path: Path) -> None:
    from minigpt.common.files import load_tensors, save_tensors

    sampler = BatchSampler(np.arange(5000, dtype=np.uint16), 8, 2, seed=3)
    sampler.next_batch()
    save_tensors(tmp_path / "s.safetensors", sampler.state_dict())
    resumed = BatchSampler(np.arange(5000, dtype=np.uint16), 8, 2, seed=3)
    resumed.load_state_dict(load_tensors(tmp_path / "s.safetensors")[0])
    assert torch.equal(resumed.next_batch()[0], sampler.next_batch()[0])


def test_sampler_bad_arguments() -> None:
    tokens = np.arange(10, dtype=np.uint16)
    with pytest.raises(MinigptError, match="too few"):
        BatchSampler(tokens, 10, 1, seed=0)
    BatchSampler(tokens, 9, 1, seed=0).next_batch()  # exactly one window fits
    with pytest.raises(UsageError):
        BatchSampler(tokens, 4, 0, seed=0)
    with pytest.raises(UsageError):
        BatchSampler(tokens, 4, 1, seed=0, rank=2, world_size=2)


def test_eval_batches_cover_windows_once() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    batches = list(eval_batches(tokens, 10, 16))
    ys = torch.cat([y for _, y in batches]).flatten().tolist()
    assert ys == list(range(1, 1001))  # every token after the first predicted exactly once
    shards = [torch.cat([x for x, _ in eval_batches(tokens, 10, 4, rank=r, world_size=3)]) for r in range(3)]
    assert sorted(torch.cat(shards)[:, 0].tolist()) == list(range(0, 1000, 10))
    few = list(eval_batches(tokens, 10, 4, max_batches=2))
    assert len(few) == 2 and few[0][0][0, 0] == 0 and few[-1][0][-1, 0] == 990
    # the chunk size changes how many windows share a forward pass, never which windows
    chunked = list(eval_batches(tokens, 10, 4, max_batches=2, chunk=5))
    assert [len(x) for x, _ in chunked] == [5, 3]
    assert torch.equal(torch.cat([x for x, _ in chunked]), torch.cat([x for x, _ in few]))


class _Huge:
    """A token sequence of a trillion ids, none of them stored: slices are zeros."""

    def __len__(self) -> int:
        return 10**12

    def __getitem__(self, key: slice) -> np.ndarray:
        return np.zeros(key.stop - key.start, dtype=np.uint16)


def test_eval_batches_take_memory_for_the_windows_they_evaluate_only() -> None:
    # a subset of a huge split (an evaluation's train loss on a 10 GB corpus): the window list of the
    # whole split would be 125 GB here, so building it fails; only the evaluated windows are listed
    batches = list(eval_batches(_Huge(), 64, 4, max_batches=3, rank=1, world_size=2))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 64)] * 3
    rows = eval_rows((10**12 - 1) // 64, 4, 3, rank=1, world_size=2)
    assert len(rows) == 12 and rows[-1] == (10**12 - 1) // 64 - 1
    assert len(eval_rows(10**12, 4, None)) == 10**12  # all of them: a range, not a list


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256), 10, 40) == pytest.approx(2.0)  # 8 bits per token, 4 bytes per token
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0, 10)


def test_uint32_for_large_vocabularies() -> None:
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_build_tokenizer_streams_texts_once() -> None:
    calls = []

    def texts():
        calls.append(1)
        yield from ["ab", "cd"]

    assert build_tokenizer("char", texts).chars == list("abcd") and calls == [1]


def test_unwritable_cache_is_a_one_line_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", make_text())
    blocker = write(tmp_path / "cache", "a file where the cache folder should be")
    with pytest.raises(MinigptError, match="MINIGPT_CACHE_DIR") as e:
        prepare_data(config(tmp_path, path, cache_dir=blocker / "sub"), 8, progress=False)
    assert "\n" not in str(e.value) and blocker.read_text().startswith("a file")


@pytest.mark.slow
def test_data_prep_does_not_import_torch() -> None:
    """Tokenizing stays light (the benchmark's RSS numbers rely on it); torch loads with the sampler."""
    import subprocess
    import sys

    code = "import sys, minigpt.data.dataset; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_default_tokenizer_is_bpe_512(tmp_path: Path) -> None:
    """The default measured best in bits per byte (bench/bench_tokenizers.py)."""
    cfg = DataConfig(paths=(write(tmp_path / "a.txt", make_text()),), cache_dir=tmp_path / "cache")
    assert cfg.tokenizer == "bpe"
    from minigpt.tokenizer.bpe import DEFAULT_BPE_VOCAB_SIZE

    assert DEFAULT_BPE_VOCAB_SIZE == 512


def test_inputs_are_recorded_by_content_and_changes_are_named(tmp_path: Path) -> None:
    from minigpt.corpus.inputs import fingerprint_blocks
    from minigpt.data.dataset import changed_inputs

    path, cache = tmp_path / "a.txt", tmp_path / "cache"
    text = make_text(40_000)  # over 64 KB: its stamp samples blocks of it rather than all of it
    path.write_text(text)
    data = prepare_data(config(tmp_path, path), 8, progress=False)
    (record,) = data.inputs
    assert record["path"] == str(path.resolve()) and record["role"] == "train"
    assert record["bytes"] == path.stat().st_size and record["mtime_ns"] == path.stat().st_mtime_ns
    assert len(record["fingerprint"]) == 64
    moved = [{**record, "path": "/elsewhere/a.txt"}]
    assert changed_inputs(moved, data.inputs, cache) is None  # the same text at another place
    assert changed_inputs([], data.inputs, cache) is None  # runs saved before inputs were recorded
    edited = [{**record, "fingerprint": "0" * 64}]
    assert changed_inputs(edited, data.inputs, cache) == "changed: a.txt"
    # one byte changed between the sampled blocks, same size: the fingerprint misses it, but the file's
    # modification time moved, so its sha256 is compared with the one recorded when it was tokenized
    sampled = fingerprint_blocks(len(text))
    at = next(o for o in range(0, len(text), 997) if not any(a <= o < a + n for a, n in sampled))
    path.write_text(text[:at] + "x" + text[at + 1 :])
    os.utime(path, ns=(record["mtime_ns"] + 10**9, record["mtime_ns"] + 10**9))
    now = prepare_data(config(tmp_path, path), 8, progress=False).inputs
    assert now[0]["fingerprint"] == record["fingerprint"] and now[0]["mtime_ns"] != record["mtime_ns"]
    assert changed_inputs([record], now, cache) == "changed: a.txt"
    # written again with the same text: a new modification time, the same content
    path.write_text(text)
    os.utime(path, ns=(record["mtime_ns"] + 2 * 10**9, record["mtime_ns"] + 2 * 10**9))
    now = prepare_data(config(tmp_path, path), 8, progress=False).inputs
    assert changed_inputs([record], now, cache) is None
