"""Corpora: every format and compression, document boundaries, bad records, the token store across runs,
the tokenizer sample, and training that starts before tokenizing ends (schedule, exact resume)."""

from __future__ import annotations

import builtins
import bz2
import collections
import gzip
import io
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import minigpt.corpus.encode as encode
import minigpt.corpus.ingest as ingest
import minigpt.corpus.readers as readers
import minigpt.corpus.sample as sample
from minigpt.common.files import load_tensors
from minigpt.corpus.inputs import FINGERPRINT_BLOCK, FINGERPRINT_BLOCKS, FINGERPRINT_EDGE, Source, file_kind
from minigpt.corpus.progress import Meter, Progress
from minigpt.corpus.readers import ReadOptions
from minigpt.corpus.sample import sample_texts
from minigpt.corpus.streams import RAMP_FACTOR
from minigpt.data.dataset import BatchSampler, DataConfig, prepare_data
from minigpt.errors import MinigptError
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.base import ENDOFTEXT
from minigpt.tokenizer.bpe import BPETokenizer
from minigpt.train.loop import TrainConfig, train

try:
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd  # type: ignore[no-redef]

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORDS = "the king and queen of england spoke to a citizen about bread corn and the senate".split()
COMPRESS = {
    None: lambda b: b,
    "gz": gzip.compress,
    "zst": zstd.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
}


def doc(i: int, words: int = 30) -> str:
    rng = np.random.default_rng(i)
    return f"document {i}: " + " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), words)) + ".\n"


def corpus_bytes(fmt: str, docs: list[str]) -> bytes:
    if fmt == "txt":
        return "".join(docs).encode()
    if fmt in ("jsonl", "ndjson"):
        return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)).encode()
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), buf, row_group_size=3)
    return buf.getvalue()


def write_corpus(path: Path, docs: list[str], compression: str | None = None) -> Path:
    fmt = path.suffix.lstrip(".")
    if compression:
        path = path.with_name(path.name + "." + compression)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(COMPRESS[compression](corpus_bytes(fmt, docs)))
    return path


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE learned once, given to the tests as a tokenizer.json (no training per test)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(BPETokenizer.train([doc(i) for i in range(200)], 300).to_json()))
    return path


def cfg(tmp_path: Path, *paths: Path, **kw) -> DataConfig:
    kw.setdefault("cache_dir", tmp_path / "cache")
    return DataConfig(paths=tuple(paths), **kw)


def documents_of(ds) -> list[str]:
    """The dataset's text split at end-of-text tokens (validation last: it is the corpus' end)."""
    ids = np.concatenate([ds.train[:], ds.val[:]]).tolist()
    text = ds.tokenizer.decode(ids)
    assert text.endswith(ENDOFTEXT)
    return text[: -len(ENDOFTEXT)].split(ENDOFTEXT)


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files that get tokenized (store misses), in order."""
    seen: list[Path] = []
    real = ingest.tokenize_file

    def counting(*args, **kwargs):
        seen.append(Path(kwargs.get("where", args[-1]).split(" file ", 1)[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ingest, "tokenize_file", counting)
    return seen


# ---------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("compression", [None, "gz", "zst", "bz2", "xz"])
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "ndjson", "parquet"])
def test_every_format_and_compression_gives_its_documents(
    tmp_path: Path, bpe_file: Path, fmt: str, compression: str | None
) -> None:
    docs = [doc(i) for i in range(40)]
    path = write_corpus(tmp_path / f"corpus.{fmt}", docs, compression)
    assert file_kind(path, explicit=False) == (
        "text" if fmt == "txt" else "jsonl" if fmt != "parquet" else "parquet",
        {None: None, "gz": "gzip", "zst": "zstd", "bz2": "bz2", "xz": "xz"}[compression],
    )
    ds = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 8, progress=False)
    # a text file is one document; each JSON line and Parquet row is one; every one ends with end-of-text
    assert documents_of(ds) == (["".join(docs)] if fmt == "txt" else docs)


def test_a_folder_is_walked_for_every_known_format(tmp_path: Path, bpe_file: Path) -> None:
    root = tmp_path / "data"
    write_corpus(root / "a.txt", [doc(1)])
    write_corpus(root / "sub" / "b.jsonl", [doc(2), doc(3)], "zst")
    write_corpus(root / "sub" / "deeper" / "c.parquet", [doc(4)], "gz")
    write_corpus(root / ".hidden" / "d.txt", [doc(5)])
    (root / "notes.md").write_text("not a corpus file")
    (root / "image.bin").write_bytes(b"\x00\x01")
    ds = prepare_data(cfg(tmp_path, root, tokenizer=str(bpe_file)), 4, progress=False)
    assert sorted(documents_of(ds)) == sorted(doc(i) for i in range(1, 5))
    assert len(ds.inputs) == 3


def test_text_field_names_the_json_field_and_parquet_column(tmp_path: Path, bpe_file: Path) -> None:
    lines = "".join(json.dumps({"body": doc(i), "text": 7}) + "\n" for i in range(20))
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(lines)
    table = pa.table({"body": [doc(i) for i in range(20, 40)]})
    pq.write_table(table, tmp_path / "b.parquet")
    ds = prepare_data(
        cfg(tmp_path, jsonl, tmp_path / "b.parquet", tokenizer=str(bpe_file), text_field="body"),
        8,
        progress=False,
    )
    assert sorted(documents_of(ds)) == sorted(doc(i) for i in range(40))


def test_a_literal_end_of_text_in_a_document_stays_text(tmp_path: Path, bpe_file: Path) -> None:
    docs = [doc(1), f"a document that mentions {ENDOFTEXT} in its text\n", doc(2)]
    path = write_corpus(tmp_path / "a.jsonl", docs)
    ds = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 4, progress=False)
    ids = np.concatenate([ds.train[:], ds.val[:]])
    assert int((ids == ds.tokenizer.eot_id).sum()) == 3  # one per document, none from the text


def test_jobs_join_documents_and_cut_long_ones_without_changing_ids(
    tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encode, "PIECE_CHARS", 300)
    monkeypatch.setattr(readers, "READ_BYTES", 100)
    docs = [doc(i, words=3 + 40 * (i % 3)) for i in range(30)]
    ds = prepare_data(
        cfg(tmp_path, write_corpus(tmp_path / "a.jsonl", docs), tokenizer=str(bpe_file)), 4, progress=False
    )
    tok = ds.tokenizer
    expected = [i for d in docs for i in [*tok.encode(d), tok.eot_id]]
    assert np.concatenate([ds.train[:], ds.val[:]]).tolist() == expected


# ---------------------------------------------------------------------------------------------- bad input


def one_line_error(config: DataConfig, match: str) -> str:
    with pytest.raises(MinigptError, match=match) as e:
        prepare_data(config, 4, progress=False)
    assert "\n" not in str(e.value) and e.value.exit_code == 1
    return str(e.value)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ('{"title": "x"}', "no 'text' field"),
        ('{"text": 42}', "field 'text' is int, not a string"),
        ('{"text": null}', "field 'text' is null, not a string"),
        ('{"text": "lone \\ud800 surrogate"}', r"a lone surrogate \(U\+D800\)"),
    ],
)
def test_a_bad_json_line_names_file_and_line_or_is_skipped(
    tmp_path: Path, bpe_file: Path, line: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [json.dumps({"text": doc(i)}) for i in range(30)]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join([*good[:7], line, *good[7:]]) + "\n")
    message = one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), f"{path}:8: {problem}")
    assert "--skip-bad-records" in message
    # the file's end (validation, tokenized first) is stored; nothing of the span holding the bad line
    assert len(list((tmp_path / "cache" / "tokens").glob("*/done.json"))) == 1
    ds = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file), skip_bad_records=True), 4)
    assert documents_of(ds) == [doc(i) for i in range(30)]
    noted = re.escape(f"skipped 1 bad record(s) in {path} (the first: {path}:8: ") + problem
    assert re.search(noted, capsys.readouterr().err)


def test_invalid_utf8_in_a_json_line(tmp_path: Path, bpe_file: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), rf"{path}:2: invalid UTF-8 at byte 13")


def test_an_overlong_json_line_is_never_held_whole(
    tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line past the record limit (64 MB; 1 KB here) is an error naming it, or skipped with the flag."""
    monkeypatch.setattr(readers, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(readers, "READ_BYTES", 256)
    huge = json.dumps({"text": "x" * 5000})
    lines = [json.dumps({"text": doc(i)}) for i in range(20)]
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join([*lines[:3], huge, *lines[3:]]) + "\n").encode()))
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), rf"{path}:4: a line longer than 0 MB")
    ds = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file), skip_bad_records=True), 4, progress=False)
    assert documents_of(ds) == [doc(i) for i in range(20)]


@pytest.mark.parametrize("compression", ["gz", "zst", "bz2", "xz"])
def test_truncated_and_corrupt_compressed_files(tmp_path: Path, bpe_file: Path, compression: str) -> None:
    data = COMPRESS[compression](corpus_bytes("jsonl", [doc(i) for i in range(300)]))
    path = tmp_path / f"a.jsonl.{compression}"
    path.write_bytes(data[: len(data) // 2])
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), f"{path} is truncated")
    corrupt = bytearray(data)
    corrupt[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(corrupt))
    with pytest.raises(MinigptError) as e:
        prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 4, progress=False)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_parquet_files(tmp_path: Path, bpe_file: Path) -> None:
    good = corpus_bytes("parquet", [doc(i) for i in range(20)])
    path = tmp_path / "a.parquet"
    path.write_bytes(good[: len(good) // 2])
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), f"{path} is not a readable Parquet file")
    pq.write_table(pa.table({"text": list(range(5))}), path)
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), "column 'text' holds int64, not text")
    pq.write_table(pa.table({"body": ["a"]}), path)
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), "has no column 'text' .*--text-field")
    pq.write_table(pa.table({"text": [doc(1), None, doc(2), doc(3)]}), path)
    one_line_error(cfg(tmp_path, path, tokenizer=str(bpe_file)), f"{path}: row 2: 'text' is null")


@pytest.mark.slow
def test_pyarrow_is_imported_only_for_parquet(tmp_path: Path, bpe_file: Path) -> None:
    path = write_corpus(tmp_path / "a.jsonl", [doc(i) for i in range(20)], "zst")
    code = (
        "import sys; from pathlib import Path; from minigpt.data.dataset import DataConfig, prepare_data; "
        f"prepare_data(DataConfig(paths=(Path({str(path)!r}),), tokenizer={str(bpe_file)!r}, "
        f"cache_dir=Path({str(tmp_path / 'cache')!r})), 4, progress=False); "
        "assert 'pyarrow' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- the store


def test_adding_a_file_tokenizes_only_it(tmp_path: Path, bpe_file: Path, tokenized: list[Path]) -> None:
    """In a folder of many files, validation is whole files from the end (15% here: the last file, and not
    enough of the one before to cut it), so a file added anywhere leaves the others' tokens as they are."""
    root = tmp_path / "books"
    first = [
        write_corpus(root / f"p{n:02d}.jsonl", [doc(i) for i in range(10 * n, 10 * n + 10)])
        for n in range(10)
    ]
    config = cfg(tmp_path, root, tokenizer=str(bpe_file), val_fraction=0.15)
    ds = prepare_data(config, 4, progress=False)
    assert sorted(tokenized) == sorted(first)
    assert ds.tokenizer.decode(ds.val[:].tolist()).split(ENDOFTEXT)[:-1] == [doc(i) for i in range(90, 100)]
    added = write_corpus(root / "c.txt", [doc(999)], "xz")
    tokenized.clear()
    ds = prepare_data(config, 4, progress=False)
    assert tokenized == [added]
    assert sorted(documents_of(ds)) == sorted([doc(i) for i in range(100)] + [doc(999)])
    tokenized.clear()
    prepare_data(config, 4, progress=False)
    assert tokenized == []  # a second run starts at once


def test_a_file_left_half_tokenized_keeps_its_finished_chunks(
    tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encode, "CHUNK_FIRST_CHARS", 500)
    monkeypatch.setattr(encode, "CHUNK_MAX_CHARS", 500)
    monkeypatch.setattr(encode, "PIECE_CHARS", 200)
    path = write_corpus(tmp_path / "a.jsonl", [doc(i) for i in range(60)])
    whole = documents_of(prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 4, progress=False))
    # the file's training span: the entry with the most chunks (the other is its end, validation)
    entry = max((tmp_path / "cache" / "tokens").iterdir(), key=lambda e: len(list(e.glob("chunk-*.json"))))
    chunks = sorted(entry.glob("chunk-*.json"))
    assert len(chunks) > 5
    (entry / "done.json").unlink()  # as if the run ended half-way: the last chunks and done.json missing
    for meta in chunks[3:]:
        meta.unlink()
    encoded: list[int] = []
    real = encode.Encoder.__call__
    monkeypatch.setattr(encode.Encoder, "__call__", lambda self, job: encoded.append(1) or real(self, job))
    again = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 4, progress=False)
    assert documents_of(again) == whole
    assert 0 < len(encoded) < len(whole)  # the first three chunks were read, not encoded again


def test_tokenizer_file_of_a_run_can_be_given(tmp_path: Path, bpe_file: Path) -> None:
    ds = prepare_data(
        cfg(tmp_path, write_corpus(tmp_path / "a.txt", [doc(1)]), tokenizer=str(bpe_file)), 4, progress=False
    )
    assert ds.tokenizer.to_json() == json.loads(bpe_file.read_text())


# ---------------------------------------------------------------------------------------------- the split


def test_one_text_file_holds_out_its_last_tenth(tmp_path: Path, bpe_file: Path) -> None:
    """A single text file (tinyshakespeare's case) is one document: the cut falls inside it, at the last
    10% of its bytes moved on to where a new piece starts, so its two halves tokenize as the whole does."""
    text = "".join(doc(i, 60) for i in range(300))
    path = tmp_path / "book.txt"
    path.write_text(text)
    ds = prepare_data(cfg(tmp_path, path, tokenizer=str(bpe_file)), 8, progress=False)
    val = ds.tokenizer.decode(ds.val[:].tolist())
    assert val.endswith(ENDOFTEXT)
    tail = val.removesuffix(ENDOFTEXT)
    start = len(text) - len(tail)
    assert text.endswith(tail) and 0 <= start - (len(text) - round(len(text) * 0.1)) <= 16
    assert text[start] == " " and text[start - 1].isalpha() and text[start + 1].isalpha()
    tok = ds.tokenizer
    assert ds.train[:].tolist() + ds.val[:].tolist() == tok.encode(text) + [tok.eot_id]


def test_validation_is_the_corpus_end_in_whole_documents(tmp_path: Path, bpe_file: Path) -> None:
    """A folder of JSON lines shards, each larger than the validation share: the cut falls inside the last
    one at a line, so validation is the corpus's last documents, whole, about --val-fraction of them."""
    root = tmp_path / "shards"
    for n in range(3):
        write_corpus(root / f"s{n}.jsonl", [doc(i) for i in range(100 * n, 100 * n + 100)])
    ds = prepare_data(cfg(tmp_path, root, tokenizer=str(bpe_file)), 4, progress=False)
    val = ds.tokenizer.decode(ds.val[:].tolist()).split(ENDOFTEXT)
    k = len(val) - 1
    assert val[-1] == "" and val[:-1] == [doc(i) for i in range(300 - k, 300)] and 25 <= k <= 35
    assert sorted(documents_of(ds)) == sorted(doc(i) for i in range(300))


class _Counted:
    """A file object that adds the bytes read through it to `counts[name]`."""

    def __init__(self, f, counts: collections.Counter, name: str) -> None:
        self._f, self._counts, self._name = f, counts, name

    def read(self, *args):
        data = self._f.read(*args)
        self._counts[self._name] += len(data)
        return data

    def readinto(self, buffer):
        n = self._f.readinto(buffer)
        self._counts[self._name] += n or 0
        return n

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


@pytest.mark.slow
def test_a_warm_run_reads_only_sampled_blocks_of_its_files(
    tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second run on the same corpus stamps each file from a few blocks and finds its tokens, its split
    and its tokenizer by those stamps: it reads no file whole (a cold run reads each one at least twice:
    tokenizing, then hashing)."""

    def noisy(i: int) -> str:  # random numbers keep the compressed files large
        return f"{np.random.default_rng(i).integers(1 << 62, size=12)} {doc(i)}"

    root = tmp_path / "corpus"
    files = [
        write_corpus(root / "a.txt", [doc(i, 60) for i in range(2000)]),
        write_corpus(root / "b.jsonl", [noisy(i) for i in range(2000, 3000)], "gz"),
        write_corpus(root / "c.jsonl", [noisy(i) for i in range(3000, 4000)], "zst"),
    ]
    assert all(f.stat().st_size > 100_000 for f in files)
    counts: collections.Counter = collections.Counter()
    real_open = builtins.open
    names = {str(f) for f in files}

    def counting_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        return _Counted(f, counts, str(file)) if str(file) in names else f

    monkeypatch.setattr(builtins, "open", counting_open)
    config = cfg(tmp_path, root, tokenizer=str(bpe_file))
    prepare_data(config, 8, progress=False)
    assert all(counts[str(f)] >= 2 * f.stat().st_size for f in files)  # the instrument sees whole reads
    counts.clear()
    warm = prepare_data(config, 8, progress=False)
    assert warm.tokenized_at_start
    stamp = 2 * FINGERPRINT_EDGE + FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK
    assert all(0 < counts[str(f)] <= stamp < f.stat().st_size for f in files), counts


# ---------------------------------------------------------------------------------------------- the sample


@pytest.mark.slow
def test_the_tokenizer_sample_is_drawn_evenly_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Markers at the start, middle and end of a plain file are all in a sample 1/8 of the corpus' size; a
    compressed file (no reading from its middle) gives the start of its text, as much as its share, so the
    sample never decompresses more than its size."""
    sources = []
    for n, compression in enumerate([None, "zst"]):
        # each eighth of the file spans several zstd blocks (128 KB), the finest a decompressor can seek
        # (random numbers keep the compression ratio, so the blocks per eighth, realistic)
        rng = np.random.default_rng(n)
        lines = [
            json.dumps({"text": f"marker-{n}-{part} {rng.integers(1 << 62, size=8)} " + doc(i)})
            for part in range(8)
            for i in range(2000)
        ]
        path = tmp_path / f"f{n}.jsonl"
        path.write_bytes(COMPRESS[compression]("\n".join(lines).encode() + b"\n"))
        if compression:
            path = path.rename(path.with_name(path.name + ".zst"))
        kind = file_kind(path, explicit=True)
        sources.append(Source(path, path.stat().st_size, 0, "x", *kind))
    total = sum(s.size for s in sources)
    monkeypatch.setattr(sample, "REGION_BYTES", 2000)
    text = "\n".join(sample_texts(sources, ReadOptions(), total // 8, lambda n: None))
    seen = [{part for part in range(8) if f"marker-{n}-{part} " in text} for n in range(2)]
    assert {0, 7} <= seen[0] and len(seen[0]) >= 6, seen
    assert seen[1] == {0}, seen
    assert len(text.encode()) < total // 4  # bounded (compressed files: by their compressed size)


@pytest.mark.slow
def test_bpe_learns_from_the_sample_when_the_corpus_is_larger(tmp_path: Path, capsys) -> None:
    path = write_corpus(tmp_path / "a.jsonl", [doc(i, 400) for i in range(800)])
    assert path.stat().st_size > 1 << 20
    prepare_data(cfg(tmp_path, path, vocab_size=300, tokenizer_sample="1MB"), 8)
    assert "from a 1.0 MB sample of" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- schedule


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode, "CHUNK_FIRST_CHARS", 2000)
    monkeypatch.setattr(encode, "CHUNK_MAX_CHARS", 4000)
    monkeypatch.setattr(encode, "PIECE_CHARS", 500)


def many_docs(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for n in range(4):
        write_corpus(root / f"part{n}.jsonl", [doc(i) for i in range(n * 100, n * 100 + 100)])
    return root


def test_the_schedule_follows_the_batch_not_the_clock(
    tmp_path: Path, bpe_file: Path, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch draws from the first L(b) tokens; L depends on the batch alone, however far tokenizing is,
    and a batch that needs an unready chunk waits: a slowed worker gives the same windows."""
    root = many_docs(tmp_path)
    config = cfg(tmp_path, root, tokenizer=str(bpe_file))
    fast = prepare_data(config, 8, progress=False)  # everything tokenized first (and cached in tmp/cache)
    lengths_fast = [fast.train.length_for(b, True, 8 * 8) for b in range(40)]
    boundaries = fast.train._boundaries
    assert lengths_fast == [
        min(x for x in boundaries if x >= (b + 1) * 64 * RAMP_FACTOR)
        if (b + 1) * 64 * RAMP_FACTOR <= boundaries[-1]
        else boundaries[-1]
        for b in range(40)
    ]
    assert lengths_fast[0] < lengths_fast[-1] == len(fast.train)

    gate = threading.Event()
    real = encode._close

    def slow_close(*args):  # each chunk lands only once the test lets it
        gate.wait()
        return real(*args)

    monkeypatch.setattr(encode, "_close", slow_close)
    slow_cfg = cfg(tmp_path / "slow", root, tokenizer=str(bpe_file))
    opener = threading.Timer(0, gate.set)
    opener.start()
    slow = prepare_data(slow_cfg, 8, progress=False, background=True)
    try:
        assert not slow.tokenized_at_start
        a = BatchSampler(fast.train, 8, 8, seed=3, ramp=True)
        b = BatchSampler(slow.train, 8, 8, seed=3, ramp=True)
        for _ in range(40):
            xa, _ = a.next_batch()
            xb, _ = b.next_batch()
            assert torch.equal(xa, xb)
    finally:
        slow.close()
        opener.cancel()


def test_without_the_ramp_batches_draw_from_everything(
    tmp_path: Path, bpe_file: Path, small_chunks: None
) -> None:
    root = many_docs(tmp_path)
    ds = prepare_data(cfg(tmp_path, root, tokenizer=str(bpe_file)), 8, progress=False)
    assert ds.tokenized_at_start is False and ds.complete
    assert ds.train.length_for(0, False, 64) == ds.train.total
    again = prepare_data(cfg(tmp_path, root, tokenizer=str(bpe_file)), 8, progress=False)
    assert again.tokenized_at_start  # the store held it all: a run on it samples uniformly from step 0


@pytest.mark.slow
def test_a_run_started_while_tokenizing_resumes_bitwise(
    tmp_path: Path, bpe_file: Path, small_chunks: None
) -> None:
    """N steps straight equal N/2 steps, a stop, then a resume, both started on a cold store (each its own),
    with the schedule recorded in the checkpoint."""
    root = many_docs(tmp_path)
    tcfg = TrainConfig(
        preset="tiny", batch_size=4, eval_iters=2, eval_every=4, log_every=4, max_iters=12, warmup=2,
        device="cpu", dtype="float32", overrides={"dropout": 0.0, "block_size": 16},
    )  # fmt: skip
    straight = train(tcfg, cfg(tmp_path / "a", root, tokenizer=str(bpe_file)), out=tmp_path / "straight")

    def stop_at_6(step: int) -> None:
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)

    split_data = cfg(tmp_path / "b", root, tokenizer=str(bpe_file))
    first = train(tcfg, split_data, out=tmp_path / "split", on_step=stop_at_6)
    assert first.interrupted and first.state.step == 6
    state, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    assert int(state["sampler/ramp"]) == 1
    resumed = train(TrainConfig(), resume=tmp_path / "split")
    assert resumed.state.step == 12
    a, _ = load_tensors(tmp_path / "straight" / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    for key in a:
        if key.startswith(("model/", "optim/")):
            assert torch.equal(a[key], b[key]), key
    assert straight.metrics[-1]["val_loss"] == resumed.metrics[-1]["val_loss"]


# ---------------------------------------------------------------------------------------------- progress


def test_progress_says_bytes_speed_and_time_left_with_a_fake_clock() -> None:
    now = [100.0]
    meter = Meter("tokenizing", 1_000_000_000, lambda: now[0])
    meter(250_000_000)
    now[0] += 25
    assert meter.status() == "tokenizing: 250 MB of 1.0 GB (25%), 10.0 MB/s, 1:15 left"


def test_log_progress_prints_plain_lines_while_a_phase_runs() -> None:
    lines: list[str] = []
    printed = threading.Event()
    progress = Progress(True, terminal=False, interval=0.0)
    progress.note = lambda message: (lines.append(message), printed.set())  # type: ignore[method-assign]
    with progress.phase("hashing inputs", 100) as meter:
        meter(40)
        printed.clear()
        assert printed.wait(60)  # a line printed after the 40 bytes were counted
    assert lines[-1].startswith("hashing inputs: 40 bytes of 100 bytes (40%), ")


# ---------------------------------------------------------------------------------------------- torchrun

PREPARE_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import minigpt.corpus.ingest as ingest
from minigpt.data.dataset import DataConfig
from minigpt.data.prepare import prepare

def say(*words):  # one write() a line: both processes share the pipe (print, unbuffered, writes word by word)
    os.write(1, (" ".join(map(str, words)) + "\n").encode())

real = ingest.tokenize_file
def tokenize_file(*args, **kwargs):  # say which process tokenized which file
    say("rank", os.environ["RANK"], "tokenized", args[-1])  # "<role> file <path>"
    return real(*args, **kwargs)
ingest.tokenize_file = tokenize_file
folder, tokenizer, cache = sys.argv[1:]
done = prepare(DataConfig(paths=(Path(folder),), tokenizer=tokenizer, cache_dir=Path(cache)), progress=False)
say("rank", os.environ["RANK"], "prepared", json.dumps([done.train_tokens, done.val_tokens, done.files]))
"""


@pytest.mark.slow
def test_prepare_under_two_process_torchrun_splits_the_files(tmp_path: Path, bpe_file: Path) -> None:
    """Each process tokenizes its share of the files into the shared store, then both see all of it; a
    later single process reuses everything and gets the same tokens."""
    root = tmp_path / "corpus"
    files = [
        write_corpus(root / f"part{n}.jsonl", [doc(i) for i in range(n * 50, n * 50 + 50)]) for n in range(4)
    ]
    script = tmp_path / "prepare.py"
    script.write_text(PREPARE_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINIGPT_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(root), str(bpe_file), str(tmp_path / "cache")]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # the parts: three files whole, the last one's start and its end (validation, cut inside it)
    by_rank = {
        r: {line.split(" tokenized ", 1)[1] for line in lines if line.startswith(f"rank {r} tokenized")}
        for r in "01"
    }
    assert by_rank["0"] and by_rank["1"] and not by_rank["0"] & by_rank["1"]
    assert len(by_rank["0"] | by_rank["1"]) == 5
    assert {Path(w.split(" file ", 1)[1]) for w in by_rank["0"] | by_rank["1"]} == set(files)
    results = {line.split(" prepared ")[1] for line in lines if " prepared " in line}
    assert len(results) == 1, out.stdout + out.stderr  # both processes finished with the whole corpus
    seen: list[Path] = []
    real = ingest.tokenize_file
    try:
        ingest.tokenize_file = lambda *a, **k: seen.append(a[-1]) or real(*a, **k)  # type: ignore[assignment]
        alone = prepare_data(cfg(tmp_path, root, tokenizer=str(bpe_file)), 8, progress=False)
    finally:
        ingest.tokenize_file = real  # type: ignore[assignment]
    assert seen == [] and json.loads(results.pop()) == [alone.train.total, len(alone.val), 4]


@pytest.mark.slow
def test_a_resume_on_a_grown_corpus_needs_allow_data_change_and_tokenizes_only_the_new_file(
    tmp_path: Path, bpe_file: Path, tokenized: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))  # a resume uses this machine's cache
    root = tmp_path / "corpus"
    for n in range(10):  # validation: the last file whole (see test_adding_a_file_tokenizes_only_it)
        write_corpus(root / f"p{n:02d}.jsonl", [doc(i) for i in range(n * 30, n * 30 + 30)], "zst")
    tcfg = TrainConfig(preset="tiny", batch_size=4, eval_iters=2, eval_every=4, max_iters=4, device="cpu",
                       dtype="float32", overrides={"block_size": 16})  # fmt: skip
    train(tcfg, DataConfig(paths=(root,), tokenizer=str(bpe_file), val_fraction=0.15), out=tmp_path / "run")
    added = write_corpus(root / "a.parquet", [doc(i) for i in range(500, 512)], "gz")
    tokenized.clear()
    with pytest.raises(MinigptError, match=r"the text differs from .*new: a.parquet.gz.*--allow-data-change"):
        train(TrainConfig(max_iters=6), resume=tmp_path / "run")
    resumed = train(TrainConfig(max_iters=6), resume=tmp_path / "run", allow_data_change=True)
    assert resumed.state.step == 6 and set(tokenized) <= {added}


# ---------------------------------------------------------------------------------------------- command line


@pytest.mark.slow
def test_prepare_then_train_reuses_everything(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minigpt.cli.main import app

    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "corpus"
    write_corpus(root / "a.jsonl", [doc(i) for i in range(150)], "gz")
    lines = "".join(json.dumps({"text": doc(i)}) + "\n" for i in range(150, 300)) + "not json\n"
    (root / "b.ndjson").write_text(lines)
    bad = runner.invoke(app, ["prepare", str(root), "--vocab-size", "300"])
    assert bad.exit_code == 1 and f"{root / 'b.ndjson'}:151: not valid JSON" in bad.output
    opts = ["--vocab-size", "300", "--skip-bad-records", "--tokenizer-sample", "1MB"]
    done = runner.invoke(app, ["prepare", str(root), *opts])
    assert done.exit_code == 0, done.output
    assert "prepared 2 file(s)" in done.stdout and "tokenizer: bpe (300 tokens) (" in done.stdout
    train = runner.invoke(
        app,
        [
            "train",
            str(root),
            *opts,
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--max-iters",
            "2",
            "--eval-iters",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
        ],  # fmt: skip
    )
    assert train.exit_code == 0, train.output
    assert (
        "reusing the bpe (300 tokens) tokenizer" in train.output
        and "reusing the tokens of 2 file(s)" in train.output
    )


def test_data_options_are_checked_in_one_line(runner, tmp_path: Path) -> None:
    from minigpt.cli.main import app

    path = write_corpus(tmp_path / "a.txt", [doc(1)])
    for args, message in (
        (["--tokenizer-sample", "10KB"], "--tokenizer-sample must be at least 1MB"),
        (["--tokenizer-sample", "lots"], "'lots' is not a size"),
        (["--text-field", ""], "--text-field must name"),
    ):
        result = runner.invoke(app, ["prepare", str(path), *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_a_stream_reads_its_windows_from_the_chunk_files(tmp_path: Path) -> None:
    """Windows are read (not memory-mapped) across chunk boundaries; an id past the vocabulary and a chunk
    shorter than its JSON says are one-line errors naming the file."""
    from minigpt.corpus.store import ChunkIds
    from minigpt.corpus.streams import TokenStream

    ids = np.arange(30, dtype=np.uint16)
    paths = [tmp_path / f"chunk-{i}.bin" for i in range(3)]
    for i, path in enumerate(paths):
        ids[10 * i : 10 * (i + 1)].tofile(path)
    stream = TokenStream(np.dtype(np.uint16), vocab_size=30)
    for path in paths:
        stream.append(ChunkIds(path, np.dtype(np.uint16), 10), str(path))
    for start, stop in ((0, 30), (3, 7), (8, 23), (19, 21), (29, 30), (5, 5)):
        window = stream[start:stop]
        assert window.flags.writeable and window.dtype == np.uint16
        np.testing.assert_array_equal(window, ids[start:stop])
    np.append(ids[:10], 30).astype(np.uint16).tofile(paths[0])  # a forged id
    short = TokenStream(np.dtype(np.uint16), vocab_size=30)
    short.append(ChunkIds(paths[0], np.dtype(np.uint16), 11), str(paths[0]))
    with pytest.raises(MinigptError, match=r"chunk-0.bin holds token id 30, past the vocabulary"):
        short[5:11]
    ids[:5].tofile(paths[1])  # cut short after it was checked
    with pytest.raises(MinigptError, match=r"chunk-1.bin ended early .* damaged; delete"):
        stream[12:18]
