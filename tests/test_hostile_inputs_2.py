"""Hostile inputs, round 2, by surface: untrusted JSON, its numbers and shapes (conversations, corpus records,
adapters, run folders, imported models), corpus files and the token store, numeric options, sampling, and the
server's request bodies.

The command line cases are `Attack` rows run by test_hostile_inputs' harness: a real `python -m minigpt`
process under address-space, file-size and time limits, refused in one line (or recovering), nothing written
outside its temporary folder. Decompression bombs are made here from repeated bytes by zstd's streaming
compressor: tens of megabytes of data in a few kilobytes on disk. Each surface is a list in SURFACES: to add a case, add a row to its surface's
list; a new surface is a new entry. The server's cases drive a real server (under the same address-space
limit) over raw HTTP, or the application in this process where a step must be made to wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import test_hostile_inputs as harness
from conftest import ROOT, slow_but
from test_hostile_inputs import (
    CHAT,
    CORPUS,
    GENERATE,
    TIME_LIMIT,
    TRAIN,
    Attack,
    chat_jsonl,
    check,
    child_env,
    edit_adapter,
    fine_tune,
    from_hf,
    hf_dir,
    limit_resources,
    lora_then,
    minigpt,
    train_with,
    with_run,
)

try:  # Python 3.14's standard library; the backport before it
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(3 * TIME_LIMIT + 60)

HUGE = "1" + "0" * 4999  # a JSON number of 5,000 digits: past the interpreter's limit on integer digits


# ---------------------------------------------------------------------------------------------- the reading


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("NaN", "NaN, which is not a JSON number"),
        ('{"a": [-Infinity]}', "-Infinity, which is not a JSON number"),
        ("1e999", "the number 1e999 is past a float's range"),
        ("-" + HUGE, "a number of 5,000 digits"),
        ("[" * 100_000, "nested too deeply"),
        ('{"a": 1', "Expecting ',' delimiter at line 1, column 8"),
        (b'"\xff"', "not UTF-8 (invalid start byte at byte 1)"),
    ],
)
def test_strict_json_refuses_what_is_not_json_or_past_bounds(text: str | bytes, reason: str) -> None:
    from minigpt.common.strict_json import JsonError, parse_json

    with pytest.raises(JsonError) as refused:
        parse_json(text)
    assert str(refused.value) == reason


def test_strict_json_reads_what_json_holds() -> None:
    from minigpt.common.strict_json import parse_json

    text = json.dumps({"big": 10**63, "small": -(10**63), "x": [1.5e300, 5e-324, True, None, "Infinity"]})
    assert parse_json(text) == json.loads(text) and parse_json(text.encode()) == json.loads(text)
    assert parse_json('{"loss": NaN, "best": Infinity}', nan=True)["best"] == float("inf")


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ([2, -1], "has a negative dimension"),
        ([2, True], "is not a list of integer dimensions"),
        ([2, 1.0], "is not a list of integer dimensions"),
        ([2**24, 2**25], "is larger than the 281,474,976,710,656 elements a tensor can hold"),
        ([0, 10**30], "is larger than the 281,474,976,710,656 elements"),
        ([1] * 65, "has 65 dimensions, more than the 64 a tensor can"),
    ],
)
def test_shapes_are_bounded(shape: Any, reason: str) -> None:
    from minigpt.common.strict_json import JsonError, checked_shape

    assert checked_shape([0, 2**48], "w") == [0, 2**48] and checked_shape([], "w") == []
    with pytest.raises(JsonError, match=reason):
        checked_shape(shape, "the shape of 'w'")


# ---------------------------------------------------------------------------------------------- builders


def huge_number(name: str) -> Callable[[Path], None]:
    """Give the JSON object in folder/name a key holding HUGE (json.dumps cannot write such a number)."""

    def tamper(folder: Path) -> None:
        path = folder / name
        path.write_text(f'{{"x": {HUGE}, ' + path.read_text().lstrip()[1:])

    return tamper


def claimed_shape(name: str, shape: str) -> Callable[[Path], None]:
    """Rewrite the safetensors file folder/name so that its first tensor claims `shape` (JSON text, which may
    be what json.dumps would not write: Infinity, a 5,000-digit number)."""

    def tamper(folder: Path) -> None:
        path = folder / name
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header[next(k for k in header if k != "__metadata__")]["shape"] = "SHAPE"
        text = json.dumps(header).replace('"SHAPE"', shape).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])

    return tamper


def chat_run_then(*command: str, conversations: str | None = None) -> Callable[[Path], list[str]]:
    """The char fixture with the chat tokens, then `command` ({run}: it; {chat}: a conversation file
    ending in the line `conversations`)."""

    def build(tmp: Path) -> list[str]:
        from test_serve_chat import chat_run  # imports the serve extra: skipped without it

        run = chat_run(tmp)
        chat = chat_jsonl(tmp, conversations) if conversations is not None else tmp / "none.jsonl"
        return [part.replace("{run}", str(run)).replace("{chat}", str(chat)) for part in command]

    return build


def jsonl_corpus(tmp: Path, line: str) -> Path:
    """A JSON-lines corpus of the fixture's lines, one record each, then `line`."""
    records = [json.dumps({"text": t}) for t in CORPUS.read_text(encoding="utf-8").splitlines()]
    path = tmp / "corpus.jsonl"
    path.write_text("\n".join([*records, line]) + "\n", encoding="utf-8")
    return path


def zstd_bomb(path: Path, head: bytes, size: int, repeated: bytes = b"\0") -> Path:
    """`head`, then `repeated` over and over: `size` bytes once decompressed, a few KB on disk."""
    block = repeated * ((1 << 20) // len(repeated))
    with zstd.ZstdFile(path, "w") as out:
        out.write(head)
        written = len(head)
        while written < size:
            out.write(block[: size - written])
            written += len(block)
    assert path.stat().st_size < 64 << 10
    return path


def parquet_with_two_text_columns(tmp: Path) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = pa.array(CORPUS.read_text(encoding="utf-8").splitlines())
    path = tmp / "corpus.parquet"
    pq.write_table(pa.Table.from_arrays([docs, docs], names=["text", "text"]), path)
    return path


def prepare_char(make: Callable[[Path], Path], *options: str) -> Callable[[Path], list[str]]:
    """`prepare --tokenizer char` of the file make(tmp) plants."""
    return lambda tmp: ["prepare", str(make(tmp)), "--tokenizer", "char", *options]


def prepared_then(tamper: Callable[[Path], Any]) -> Callable[[Path], list[str]]:
    """`prepare --tokenizer char` of the fixture corpus, then `tamper` with each entry of its token store:
    the same again."""

    def build(tmp: Path) -> list[str]:
        args = ["prepare", str(CORPUS), "--tokenizer", "char"]
        first = minigpt(tmp, args)
        assert first.returncode == 0, first.stderr
        entries = [e for e in (tmp / "cache" / "tokens").iterdir() if (e / "done.json").is_file()]
        assert entries, "prepare stored no tokens"
        for entry in entries:
            tamper(entry)
        return args

    return build


def edit_json(path: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def done_claims(chunks: int) -> Callable[[Path], None]:
    return lambda entry: edit_json(entry / "done.json", lambda m: m.update(chunks=chunks))


def grown_sparse(keep_done: bool) -> Callable[[Path], None]:
    """The entry's first chunk grown to a 4 TiB sparse file, its JSON claiming the 2**41 ids that fill it
    (and done.json the same, or gone): every size agrees, and reading it all takes hours."""

    def tamper(entry: Path) -> None:
        tokens = 1 << 41
        bin_path = entry / "chunk-000000.bin"
        itemsize = bin_path.stat().st_size // json.loads((entry / "chunk-000000.json").read_text())["tokens"]
        try:
            os.truncate(bin_path, tokens * itemsize)
        except OSError as e:  # a filesystem without files this large
            pytest.skip(f"cannot grow a sparse file to 4 TiB here: {e}")
        edit_json(entry / "chunk-000000.json", lambda m: (m.update(tokens=tokens), m.pop("stamp", None)))
        others = sum(p.stat().st_size for p in entry.glob("chunk-*.bin") if p != bin_path) // itemsize
        if keep_done:
            edit_json(entry / "done.json", lambda m: m.update(tokens=tokens + others))
        else:
            (entry / "done.json").unlink()

    return tamper


def hf_config_only(config: dict[str, Any], raw: str = "") -> Callable[[Path], list[str]]:
    """`convert from-hf` of a folder holding only config.json: `config`, then `raw` JSON text spliced in
    (for what json.dumps would not write). The config is read before any weights are looked for."""

    def build(tmp: Path) -> list[str]:
        src = tmp / "hf"
        src.mkdir()
        text = json.dumps(config)
        (src / "config.json").write_text(text[:-1] + raw + "}" if raw else text)
        return from_hf(src)

    return build


def qwen3(**fields: Any) -> dict[str, Any]:
    return {"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 2, **fields}


def aperiodic_layers(n: int) -> list[str]:
    """`n` layer types, sliding or full at random (no period shorter than about n), the last one full."""
    kinds = random.Random(0).choices(["sliding_attention", "full_attention"], k=n - 1)
    return [*kinds, "full_attention"]


def hf_then(tamper: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    """A Hugging Face GPT-2 folder exported from the bpe fixture, `tamper`ed, then `convert from-hf`."""

    def build(tmp: Path) -> list[str]:
        src = hf_dir(tmp)
        tamper(src)
        return from_hf(src)

    return build


def demo_for(*options: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["demo", "--out", str(tmp / "demo"), *options]


LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2}
INFINITE_SHAPE = "[Infinity, 32]"

# ---------------------------------------------------------------------------------------------- surfaces

CONVERSATIONS = [
    Attack(
        "a 5,000-digit number in a training conversation",
        fine_tune(chat=lambda tmp: chat_jsonl(tmp, f'{{"prompt": "a", "completion": "b", "n": {HUGE}}}')),
        "chat.jsonl:41: not a JSON record (a number of 5,000 digits)",
    ),
    Attack(
        "NaN in a training conversation",
        fine_tune(chat=lambda tmp: chat_jsonl(tmp, '{"prompt": "a", "completion": "b", "n": NaN}')),
        "chat.jsonl:41: not a JSON record (NaN, which is not a JSON number)",
    ),
    Attack(
        "a content part whose text is null",
        fine_tune(
            chat=lambda tmp: chat_jsonl(
                tmp,
                '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}, '
                '{"role": "assistant", "content": "a"}]}',
            )
        ),  # fmt: skip
        "chat.jsonl:41: message 1 (user): content part 1 has text None, not a string",
    ),
    Attack(
        "a content part whose text is an object",
        fine_tune(
            chat=lambda tmp: chat_jsonl(
                tmp,
                '{"messages": [{"role": "user", "content": "a"}, '
                '{"role": "assistant", "content": [{"type": "text", "text": {"a": 1}}]}]}',
            )
        ),  # fmt: skip
        "message 2 (assistant): content part 1 has text {'a': 1}, not a string",
    ),
    Attack(
        "a piped chat line holding a 5,000-digit number",
        chat_run_then(*CHAT),
        "standard input, line 1: not a JSON record (a number of 5,000 digits)",
        stdin=f'{{"prompt": "The dog", "n": {HUGE}}}\n',
    ),
    Attack(
        "eval of conversations holding a 5,000-digit number",
        chat_run_then("eval", "{run}", "{chat}", conversations=f'{{"prompt": "a", "completion": {HUGE}}}'),
        "chat.jsonl:41: not a JSON record (a number of 5,000 digits)",
    ),
]

CORPORA = [
    Attack(
        "a 5,000-digit number in a JSON-lines corpus record",
        lambda tmp: train_with(
            "--tokenizer", "char", text=jsonl_corpus(tmp, f'{{"text": "a", "n": {HUGE}}}')
        )(tmp),
        f"corpus.jsonl:{len(CORPUS.read_text(encoding='utf-8').splitlines()) + 1}: not valid JSON (a number of "
        f"5,000 digits)",
    ),
    Attack(
        "a Parquet file with two columns named text",
        prepare_char(parquet_with_two_text_columns),
        "corpus.parquet has 2 columns named 'text'",
    ),
    Attack(
        "a .parquet.zst of a few KB that decompresses to 96 MB",
        prepare_char(lambda tmp: zstd_bomb(tmp / "corpus.parquet.zst", b"PAR1", 96 << 20)),
        "corpus.parquet.zst decompresses to more than 64 MB, the most minigpt copies out of",
    ),
]

# the store heals: an entry that does not hold what it says is tokenized again
STORE = [
    Attack("done.json claims 10**7 chunks", prepared_then(done_claims(10**7)), "tokenizing again", 0),
    Attack("done.json claims 10**9 chunks", prepared_then(done_claims(10**9)), "tokenizing again", 0),
    Attack("a chunk grown to a 4 TiB sparse file", prepared_then(grown_sparse(True)), "tokenizing again", 0),
    Attack(
        "a chunk grown to a 4 TiB sparse file, done.json gone",
        prepared_then(grown_sparse(False)),
        "tokenized",
        0,
    ),
]

ADAPTERS = [
    Attack(
        "an adapter header whose LoRA settings hold a 5,000-digit number",
        lora_then(edit_adapter(lambda t, m: m.update(lora=f'{{"rank": {HUGE}}}')), *GENERATE),
        "the LoRA settings in its header are damaged (a number of 5,000 digits)",
    ),
    Attack(
        "an adapter.safetensors header claiming the shape [Infinity, 32]",
        lora_then(claimed_shape("adapter.safetensors", INFINITE_SHAPE), *GENERATE),
        "adapter.safetensors is corrupt or not a safetensors file (Infinity, which is not a JSON number)",
    ),
]

RUN_FOLDERS = [
    *(
        Attack(
            f"model.safetensors header claiming the shape [Infinity, 32] ({command[0]})",
            with_run(claimed_shape("model.safetensors", INFINITE_SHAPE), *command),
            "model.safetensors is corrupt or not a safetensors file (Infinity, which is not a JSON number)",
        )
        for command in (("params", "{run}"), GENERATE)
    ),
    Attack(
        "model.safetensors header claiming the shape [Infinity, 32] (runs: listed as skipped)",
        with_run(claimed_shape("model.safetensors", INFINITE_SHAPE), "runs", "{run}/.."),
        "model.safetensors is corrupt or not a safetensors file (Infinity, which is not a JSON number)",
        exit_code=0,
    ),
    Attack(
        "model.safetensors header claiming a tensor of 10**40 elements",
        with_run(claimed_shape("model.safetensors", f"[{10**20}, {10**20}]"), "params", "{run}"),
        "is larger than the 281,474,976,710,656 elements a tensor can hold",
    ),
    Attack(
        "model.safetensors header claiming a 5,000-digit dimension",
        with_run(claimed_shape("model.safetensors", f"[{HUGE}]"), "params", "{run}"),
        "model.safetensors is corrupt or not a safetensors file (a number of 5,000 digits)",
    ),
    Attack(
        "config.json holding a 5,000-digit number",
        with_run(huge_number("config.json"), *GENERATE),
        "config.json is corrupt (a number of 5,000 digits): restore it from a good copy",
    ),
    Attack(
        "tokenizer.json holding a 5,000-digit number",
        with_run(huge_number("tokenizer.json"), *GENERATE),
        "tokenizer.json is corrupt (a number of 5,000 digits): restore it from a good copy",
    ),
    Attack(
        "config.json whose width has no divisor near its head count (was a search through 10**12 widths)",
        with_run(
            lambda run: (run / "config.json").write_text(
                (run / "config.json").read_text().replace('"n_embd": 32', f'"n_embd": {10**12 + 39}')
            ),
            *GENERATE,
        ),
        "n_embd (1000000000039) must be divisible by n_head (2)",
    ),
]

CONVERT = [
    Attack(
        "from-hf config.json holding a 5,000-digit number",
        hf_then(huge_number("config.json")),
        "hf/config.json is corrupt (a number of 5,000 digits)",
    ),
    Attack(
        "from-hf model.safetensors header claiming the shape [Infinity, 32]",
        hf_then(claimed_shape("model.safetensors", INFINITE_SHAPE)),
        "model.safetensors is corrupt or not a safetensors file (Infinity, which is not a JSON number)",
    ),
    Attack(
        'from-hf rms_norm_eps "abc"',
        hf_config_only({**LLAMA, "rms_norm_eps": "abc"}),
        "config.json: rms_norm_eps must be a number, got 'abc'; correct config.json",
    ),
    Attack(
        "from-hf rms_norm_eps [1]",
        hf_config_only({**LLAMA, "rms_norm_eps": [1]}),
        "config.json: rms_norm_eps must be a number, got [1]",
    ),
    Attack(
        "from-hf GPT-2 layer_norm_epsilon 1e999 (infinity)",
        hf_config_only({"model_type": "gpt2"}, raw=', "layer_norm_epsilon": 1e999'),
        "config.json is corrupt (the number 1e999 is past a float's range)",
    ),
    Attack(
        'from-hf Qwen3 max_window_layers "abc"',
        hf_config_only(qwen3(use_sliding_window=True, num_hidden_layers=4, max_window_layers="abc")),
        "config.json: max_window_layers must be an integer, got 'abc'",
    ),
    Attack(
        "from-hf Qwen3 with 1,000,000 aperiodic layer_types (a quadratic period search)",
        hf_config_only(
            qwen3(use_sliding_window=True, num_hidden_layers=10**6, layer_types=aperiodic_layers(10**6))
        ),
        "num_hidden_layers must be from 1 to 4,096, got 1,000,000",
    ),
    Attack(
        "from-hf Qwen3 with 10**9 layers and no layer_types (a list of 10**9 built first)",
        hf_config_only(qwen3(use_sliding_window=True, num_hidden_layers=10**9)),
        "num_hidden_layers must be from 1 to 4,096, got 1,000,000,000",
    ),
    Attack(
        "from-hf Qwen3 layer_types holding lists",
        hf_config_only(qwen3(use_sliding_window=True, num_hidden_layers=2, layer_types=[[1], [2]])),
        "layer_types must list full_attention or sliding_attention for each of the 2 layers",
    ),
]

OPTIONS = [
    Attack(
        "train --max-time 99999999999999999999",
        train_with("--max-time", "99999999999999999999"),
        "'99999999999999999999' is past 315,360,000 s (ten years)",
        exit_code=2,
    ),
    Attack(
        "demo --max-time 99999999999999999999",
        demo_for("--max-time", "99999999999999999999"),
        "is past 315,360,000 s (ten years)",
        exit_code=2,
    ),
    Attack(
        "train --vocab-size 99999999999999999999",
        train_with("--vocab-size", "99999999999999999999"),
        "--vocab-size 99999999999999999999 is past the 4,294,967,296 ids",
    ),
    Attack(
        "prepare --vocab-size 99999999999999999999",
        lambda tmp: ["prepare", str(CORPUS), "--vocab-size", "99999999999999999999"],
        "--vocab-size 99999999999999999999 is past the 4,294,967,296 ids",
    ),
    Attack(
        "train --tokenizer-sample of 400 digits (a float's infinity)",
        train_with("--tokenizer-sample", "9" * 400),
        "is past 4,611,686,018,427,387,904 bytes",
        exit_code=2,
    ),
    Attack(
        "serve --max-batch 99999999999999999999 (a request's n could then ask for any KV cache)",
        with_run(lambda run: None, "serve", "{run}", "--max-batch", "99999999999999999999"),
        "'--max-batch': Input should be less than or equal to 4096",
        exit_code=2,
    ),
    Attack(
        "serve --max-body of 400 digits",
        with_run(lambda run: None, "serve", "{run}", "--max-body", "9" * 400),
        "is past 4,611,686,018,427,387,904 bytes",
        exit_code=2,
    ),
]

SAMPLING = [
    *(
        Attack(
            f"generate --backend torch -t {t} (a float subnormal)",
            with_run(lambda run: None, *GENERATE, "--backend", "torch", "-t", t),
            "tokens in",  # the generation's statistics line: it ran
            exit_code=0,
        )
        for t in ("1e-40", "1e-320")
    ),
]

# surface -> its attacks
SURFACES = {
    "conversations": CONVERSATIONS,
    "corpora": CORPORA,
    "store": STORE,
    "adapters": ADAPTERS,
    "run folders": RUN_FOLDERS,
    "convert": CONVERT,
    "options": OPTIONS,
    "sampling": SAMPLING,
}
CASES = [(surface, attack) for surface, attacks in SURFACES.items() for attack in attacks]


@pytest.mark.parametrize(
    "case",
    slow_but(
        CASES, "run folders: config.json holding a 5,000-digit number", ids=lambda c: f"{c[0]}: {c[1].name}"
    ),
)
def test_attack_is_refused_cleanly(case: tuple[str, Attack], tmp_path: Path) -> None:
    check(case[1], tmp_path)


# ---------------------------------------------------------------------------------------------- corpora, mid-read


def bounded_script(tmp: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c SCRIPT ARGS` run as the harness runs minigpt: its environment, limits and time."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT, env=child_env(tmp), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        errors="backslashreplace", timeout=TIME_LIMIT, preexec_fn=limit_resources,
    )  # fmt: skip


# the characters of the sample BPE learns from (minigpt.corpus.sample), drawn from the file argv[1] with a
# quota of argv[2] bytes, counted until they pass 4 x the quota
SAMPLED = """
import sys
from pathlib import Path
from minigpt.corpus.inputs import stamp_source
from minigpt.corpus.readers import ReadOptions
from minigpt.corpus.sample import sample_texts

quota, taken = int(sys.argv[2]), 0
for text in sample_texts([stamp_source(Path(sys.argv[1]), "utf-8")], ReadOptions(), quota, lambda n: None):
    taken += len(text)
    if taken > 4 * quota:
        break
print(taken)
"""


@pytest.mark.slow
def test_a_compressed_corpus_gives_bpe_at_most_its_sample_of_text(tmp_path: Path) -> None:
    """A .jsonl.zst of a few KB on disk, far under --tokenizer-sample, decompresses to 64 MB of JSON lines:
    the sample holds at most the quota of text, counted after decompression."""
    line = json.dumps({"text": " ".join(CORPUS.read_text(encoding="utf-8").splitlines()[:3])}).encode()
    bomb = zstd_bomb(tmp_path / "corpus.jsonl.zst", b"", 64 << 20, repeated=line + b"\n")
    sampled = bounded_script(tmp_path, SAMPLED, str(bomb), str(1 << 20))
    assert sampled.returncode == 0, sampled.stderr
    assert int(sampled.stdout) <= 1 << 20, f"{int(sampled.stdout):,} characters sampled with a 1 MB quota"


# `minigpt ARGS` whose corpus file argv[1] is rewritten in place with the bytes of argv[2] (as `cat b > a`
# does) once its first block is read: the same point of the read on every machine, at any load
REWRITTEN_WHILE_READ = """
import sys
from pathlib import Path
from minigpt.corpus import ingest, readers
from minigpt.cli.main import main

target, other = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).read_bytes()
read, readers.READ_BYTES = ingest.documents, 1 << 16

def rewritten_in_place(src, *args, **kwargs):
    for n, piece in enumerate(read(src, *args, **kwargs)):
        yield piece
        if n == 0 and src.path.resolve() == target:
            with open(target, "r+b") as f:
                f.truncate(0)
                f.write(other)

ingest.documents = rewritten_in_place
sys.argv = ["minigpt", *sys.argv[3:]]
main()
"""


def tokens_prepared(proc: subprocess.CompletedProcess[str]) -> int:
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"-> ([\d,]+) tokens", proc.stdout)
    assert found, proc.stdout
    return int(found[1].replace(",", ""))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["prepare", "train"])
def test_a_corpus_file_rewritten_while_read_keeps_no_tokens(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is replaced in place by 1/100 of its size of other text once its first block is read, then
    restored byte for byte with its modification time (cp -p): the run stops in one line, and the next run
    tokenizes all of the file, as a run on a fresh cache does."""
    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8") * 20, encoding="utf-8")
    original = shutil.copy2(text, tmp_path / "original.txt")
    other = tmp_path / "other.txt"
    other.write_bytes(b"other words " * (text.stat().st_size // 1200))
    val = tmp_path / "val.txt"
    val.write_text(CORPUS.read_text(encoding="utf-8"), encoding="utf-8")
    data = [str(text), "--val-file", str(val), "--tokenizer", "char"]
    args = [command, *data, *([*TRAIN, "--out", str(tmp_path / "out")] if command == "train" else [])]
    # check() runs the command through the rewriting script, under the same limits
    monkeypatch.setattr(
        harness, "minigpt", lambda tmp, a, stdin="": bounded_script(tmp, REWRITTEN_WHILE_READ, *a)
    )
    check(
        Attack("rewritten", lambda tmp: [str(text), str(other), *args], f"{text} changed while it was read"),
        tmp_path,
    )
    shutil.copy2(original, text)  # restored as `cp -p` restores it
    again = minigpt(tmp_path, ["prepare", *data])
    assert "reusing the tokens" not in again.stderr, again.stderr
    (tmp_path / "fresh").mkdir()
    assert tokens_prepared(again) == tokens_prepared(minigpt(tmp_path / "fresh", ["prepare", *data]))


def traced_lines(run: Callable[[], Any]) -> int:
    """Lines of minigpt.corpus and minigpt.data that `run` executes on this thread (a loop's head counts
    once per pass): a measure of work that no clock or machine load changes."""
    count = 0
    roots = tuple(str(ROOT / "minigpt" / package) for package in ("corpus", "data"))

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(roots) else None

    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.slow
def test_ingest_is_linear_in_the_number_of_files(tmp_path: Path) -> None:
    """Twice the tiny files, twice the work (a step that looked at every file for each file made it 2.7x)."""
    from minigpt.data.dataset import DataConfig, prepare_data

    def work(n: int) -> int:
        folder = tmp_path / f"files-{n}"
        folder.mkdir()
        for i in range(n):
            (folder / f"{i:06d}.txt").write_text(f"tiny file {i}\n", encoding="utf-8")
        config = DataConfig(paths=(folder,), tokenizer="char", cache_dir=tmp_path / f"cache-{n}")
        return traced_lines(lambda: prepare_data(config, 1, progress=False))

    small, large = work(300), work(600)
    assert large < 2.3 * small, f"{small:,} lines for 300 files, {large:,} for 600"


# ---------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server on the torch engine (its sampling is the one a subnormal temperature broke), under the
    harness's address-space limit, serving the char fixture ("tiny") and a chat run ("chat")."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
    from test_serve import FIXTURE, Server
    from test_serve_chat import chat_run

    root = tmp_path_factory.mktemp("hostile-serve")
    shutil.copytree(FIXTURE, root / "tiny")
    s = Server(root, str(root / "tiny"), "--model", str(chat_run(root)), "--backend", "torch",
               preexec_fn=limit_resources)  # fmt: skip
    yield s
    s.stop()


def post(url: str, body: bytes, *, declared: int | None = None, chunked: bool = False) -> tuple[int, Any]:
    """POST `body` over a raw socket, sent by a thread of its own while this one reads the answer (a server
    that answers before reading it all may close the connection mid-send): (status, decoded JSON).
    `declared`: the Content-Length to claim (its bytes need not follow); `chunked`: no length, 1 MB chunks."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=120)  # a hang guard only
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {declared or len(body)}"
    head = f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n"

    def send() -> None:
        try:
            sock.sendall(head.encode())
            for i in range(0, len(body), 1 << 20):
                piece = body[i : i + (1 << 20)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sock.sendall(b"0\r\n\r\n" if chunked else b"")
        except OSError:  # the server answered and closed: the rest is not wanted
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())
    finally:
        sock.close()
        sender.join(timeout=120)


def openai_error(status: int, out: Any, wanted: int, message: str) -> None:
    assert status == wanted, out
    assert set(out["error"]) == {"message", "type", "param", "code"} and message in out["error"]["message"], (
        out
    )


def chat_body(content: Any, **fields: Any) -> bytes:
    return json.dumps(
        {"model": "chat", "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


@pytest.mark.slow
def test_a_body_past_the_cap_is_413_without_being_read(server: Any) -> None:
    """The default cap fits the largest context served (here about 1 MB): a body declaring 200 MB is
    refused before any of it is read, one streamed without a length once past the cap, and a 40 MB chat
    message either way; the server's memory stays where it was and it goes on answering."""
    before = server.rss_mb()
    status, out = post(server.url + "/v1/completions", b"", declared=200_000_000)
    openai_error(status, out, 413, "the request body is larger than this server takes (1,060,864 bytes")
    message = chat_body("a" * 40_000_000)
    for chunked in (False, True):
        openai_error(*post(server.url + "/v1/chat/completions", message, chunked=chunked), 413, "--max-body")
    assert server.rss_mb() - before < 100, "the server read a refused body"
    status, out = post(
        server.url + "/v1/completions", json.dumps({"model": "tiny", "prompt": "The"}).encode()
    )
    assert status == 200 and out["choices"][0]["text"], out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (chat_body([{"type": "text", "text": None}]), "must be a string or a non-empty list of text parts"),
        (chat_body([{"type": "text", "text": {"a": 1}}]), "must be a string or a non-empty list of text parts"),
        (f'{{"model": "chat", "seed": {HUGE}}}'.encode(),
         "the request body is not valid JSON (a number of 5,000 digits)"),
        (b'{"model": "tiny", "prompt": "The", "temperature": NaN}', "NaN, which is not a JSON number"),
    ],
    ids=["text null", "text an object", "5,000-digit number", "NaN"],
)  # fmt: skip
def test_untrusted_json_in_a_request_is_a_400(server: Any, body: bytes, message: str) -> None:
    route = "/v1/chat/completions" if b'"chat"' in body else "/v1/completions"
    openai_error(*post(server.url + route, body), 400, message)


@pytest.mark.slow
def test_a_subnormal_temperature_beside_another_request_answers_both(server: Any) -> None:
    """temperature 1e-40 is greedy (below float32's smallest normal, any temperature is); sent with another
    client's request, both are answered."""

    def complete(temperature: float) -> tuple[int, Any]:
        body = {"model": "tiny", "prompt": "The", "max_tokens": 8, "temperature": temperature, "seed": 1}
        return post(server.url + "/v1/completions", json.dumps(body).encode())

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, [1e-40, 1.0, 1e-40, 0.0]))
    assert [status for status, _ in answers] == [200] * 4, answers
    greedy = answers[3][1]["choices"][0]["text"]
    assert answers[0][1]["choices"][0]["text"] == answers[2][1]["choices"][0]["text"] == greedy


@pytest.mark.slow
def test_a_row_that_cannot_be_sampled_ends_its_own_request_alone() -> None:
    """A batch whose step gives one job NaN scores: that job ends with a 400, the other decodes on."""
    torch = pytest.importorskip("torch")
    from test_serve import FIXTURE, collecting_job

    from minigpt.generate.load import load_engine
    from minigpt.serve.batcher import Batcher, Update

    engine, tok = load_engine(FIXTURE, "torch")
    batcher = Batcher(engine, tok)
    poisoned, _ = collecting_job("a", 1, 5, 1.0, 0)
    healthy, texts = collecting_job("b", 1, 5, 1.0, 1)
    updates: list[Update] = []
    poisoned.notify = updates.append
    forward = engine.forward

    def nan_first_row(ids: Any, cache: Any) -> Any:
        logits = forward(ids, cache).clone()  # an inference tensor: written to only as a copy
        if batcher.groups[0].jobs[0] is poisoned:
            logits[0] = torch.nan
        return logits

    engine.forward = nan_first_row  # type: ignore[method-assign]
    batcher.submit(poisoned, healthy)
    for _ in range(10):
        batcher.step()
    assert (
        updates[-1].done
        and updates[-1].status == 400
        and "cannot draw the next token" in str(updates[-1].error)
    )
    assert len(texts[0]) == 5 and healthy.done and batcher.active_rows == 0


async def asgi(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    """(status, decoded JSON) of one request handed to the ASGI application `app` in this event loop."""
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop() if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a large request's JSON is parsed, /health answers: the parse is made to wait until /health has
    answered, which it could never do were the parse holding the event loop (the wait would time out)."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
    from test_serve import FIXTURE

    import minigpt.serve.app as app_module
    from minigpt.generate.config import EngineConfig
    from minigpt.serve.config import ServeConfig
    from minigpt.serve.models import load_models

    app = app_module.create_app(load_models([FIXTURE], EngineConfig(backend="numpy"), ServeConfig()))
    entered, answered, waited = threading.Event(), threading.Event(), []
    parse = app_module.parse_json

    def slow_parse(body: bytes) -> Any:
        entered.set()
        waited.append(answered.wait(60))  # False: /health did not answer while this held the parse
        return parse(body)

    monkeypatch.setattr(app_module, "parse_json", slow_parse)
    body = json.dumps({"prompt": "a" * app_module.INLINE_BODY, "bogus": 1}).encode()  # a 400 once parsed

    async def requests() -> tuple[Any, Any]:
        big = asyncio.ensure_future(asgi(app, "POST", "/v1/completions", body))
        await asyncio.to_thread(entered.wait, 60)
        health = await asgi(app, "GET", "/health")
        answered.set()
        return health, await big

    (status, health), (big_status, big) = asyncio.run(requests())
    assert status == 200 and health["status"] == "ok" and waited == [True]
    assert big_status == 400 and "bogus" in big["error"]["message"]
