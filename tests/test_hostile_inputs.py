"""Hostile-input suite: shared runs, checkpoints, tokenizer files and options, attacked through the CLI.

Every case is one `Attack` row in ATTACKS: a `build` function plants the hostile input under the test's tmp
dir and returns the CLI arguments; `check` runs them in a real `python -m minigpt` process (memory, file size
and time bounded) and holds every case to the same rules. To add a case, write its build function and add a row.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, slow_but

FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = FIXTURES / "corpus.txt"
MEMORY_LIMIT = 3 << 30  # address space of the child: a read or allocation without bound dies under it
# bytes any one file the child writes may reach: a write without bound (a decompression bomb copied out)
# fails there, and the disk never fills
FILE_LIMIT = 256 << 20
# seconds: a hang or a catastrophically backtracking regex runs past it; generous, so that a command slowed
# down by a loaded machine (importing torch alone takes 10-20 s at load 15) is never taken for one
TIME_LIMIT = 180
IGNORED = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}
TRAIN = "--preset tiny --max-iters 1 --eval-iters 1 --batch-size 2 --block-size 16 --device cpu".split()


# a case runs up to three commands (train, tamper, resume), each within TIME_LIMIT
pytestmark = pytest.mark.timeout(3 * TIME_LIMIT + 60)


@dataclass(frozen=True)
class Attack:
    name: str
    build: Callable[[Path], list[str]]  # plants the input under tmp and returns the CLI arguments
    blame: str  # what the error line must say (the file or option at fault); with exit_code 0, stderr
    exit_code: int | None = None  # None: refused with 1 or 2; 0: the CLI must recover and succeed
    stdin: str = ""  # what the command reads on its standard input (piped `chat` lines)


# ---------------------------------------------------------------------------------------------- the checker


def child_env(tmp: Path) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),  # this checkout, not wherever minigpt is installed
        "MINIGPT_CACHE_DIR": str(tmp / "cache"),
        "TIKTOKEN_CACHE_DIR": str(tmp / "tiktoken-cache"),
        "TMPDIR": str(tmp / "tmp"),  # temporary files land in the watched folder too
        "OMP_NUM_THREADS": "1",
    }


def limit_resources() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def minigpt(tmp: Path, args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minigpt", *args],
        cwd=ROOT,
        env=child_env(tmp),
        input=stdin,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=TIME_LIMIT,
        preexec_fn=limit_resources,
    )


def snapshot(*roots: Path, skip: Path) -> dict[Path, tuple[int, int]]:
    """(mtime_ns, size) of every file under roots, except under skip and caches."""
    files = {}
    for root in roots:
        for path in root.rglob("*"):
            if skip in path.parents or IGNORED & set(path.relative_to(root).parts) or not path.is_file():
                continue
            info = path.stat()
            files[path] = (info.st_mtime_ns, info.st_size)
    return files


def check(attack: Attack, tmp: Path) -> None:
    """Refused in one line (or recovered from): no traceback, within memory and time, nothing written
    outside tmp and no temp file left in the cache."""
    args = attack.build(tmp)
    before = snapshot(ROOT, tmp.parent, skip=tmp)
    try:
        proc = minigpt(tmp, args, attack.stdin)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{attack.name}: still running after {TIME_LIMIT}s")
    err = proc.stderr
    assert proc.returncode >= 0, f"{attack.name}: killed by signal {-proc.returncode}\n{err}"
    assert "Traceback" not in err and "MemoryError" not in err, f"{attack.name}:\n{err}"
    lines = err.splitlines()
    if attack.exit_code == 0:
        assert proc.returncode == 0 and attack.blame in err, f"{attack.name}: exit {proc.returncode}\n{err}"
    else:
        assert proc.returncode in ((1, 2) if attack.exit_code is None else (attack.exit_code,)), err
        assert lines and lines[-1].startswith("error: "), f"{attack.name}: last line not an error\n{err}"
        assert sum(line.startswith("error:") for line in lines) == 1, err
        assert attack.blame in lines[-1], f"{attack.name}: {lines[-1]!r} does not name {attack.blame!r}"
    assert not list((tmp / "cache").rglob(".*.tmp")), f"{attack.name}: temp files left in the cache"
    assert snapshot(ROOT, tmp.parent, skip=tmp) == before, f"{attack.name}: wrote outside its tmp dir"


# ---------------------------------------------------------------------------------------------- builders


def tampered_run(
    fixture: str, change: Callable[[dict[str, Any]], Any], prompt: str = "The"
) -> Callable[[Path], list[str]]:
    """A copy of a saved run whose tokenizer.json `change` edits in place, and `generate` on it."""

    def build(tmp: Path) -> list[str]:
        run = tmp / "run"
        shutil.copytree(FIXTURES / fixture, run)
        tokenizer = json.loads((run / "tokenizer.json").read_text(encoding="utf-8"))
        change(tokenizer)
        (run / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
        return ["generate", "--model", str(run), prompt, "--max-new-tokens", "4", "--device", "cpu"]

    return build


def train_with(*options: str, text: Path = CORPUS) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        return ["train", str(text), *options, *TRAIN, "--out", str(tmp / "out"), "--overwrite"]

    return build


def planted(make: Callable[[Path], Path], *options: str) -> Callable[[Path], list[str]]:
    """`train --tokenizer PATH` where make(tmp) plants PATH."""

    def build(tmp: Path) -> list[str]:
        return train_with("--tokenizer", str(make(tmp)), *options)(tmp)

    return build


def fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "ranks.tiktoken")  # opening it to read would block until a writer came
    return tmp / "ranks.tiktoken"


def fifo_text(tmp: Path) -> list[str]:
    os.mkfifo(tmp / "text.txt")
    return train_with(text=tmp / "text.txt")(tmp)


def ranks_file(tmp: Path, extra: str = "", size: int = 0) -> Path:
    """The bpe fixture's ranks as a .tiktoken file, plus `extra` lines, grown sparsely to `size` bytes."""
    table = json.loads((FIXTURES / "run-v0.1-bpe" / "tokenizer.json").read_text())["ranks"]
    path = tmp / "ranks.tiktoken"
    path.write_text("".join(f"{token} {rank}\n" for rank, token in enumerate(table)) + extra)
    if size:
        os.truncate(path, size)
    return path


def big_text(tmp: Path) -> Path:
    """~16 MB of text: tokenizing it takes long enough to be interrupted."""
    path = tmp / "big.txt"
    path.write_text(CORPUS.read_text(encoding="utf-8") * 500, encoding="utf-8")
    return path


# `minigpt ARGS` that sends itself SIGNAL while the token store writes its first chunk, half of it in a temp
# file: the same point of the write on every machine, at any load
KILLED_WHILE_TOKENIZING = """
import os, sys
from minigpt.corpus import store
from minigpt.cli.main import main

land, signum = store._land, int(sys.argv[1])

def half_landed_then_signal(final, data):
    # the first chunk of tokens is half written to a temp file (named as the store names its own), then
    # the signal comes: a deterministic point inside tokenizing, whatever the machine's speed
    if final.suffix == ".bin" and not getattr(store, "signalled", False):
        store.signalled = True
        final.with_name(f".{final.name}.half.{os.getpid()}@{store.host()}.tmp").write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signum)
    land(final, data)

store._land = half_landed_then_signal
sys.argv = ["minigpt", *sys.argv[2:]]
main()
"""


def killed_while_tokenizing(sig: signal.Signals) -> Callable[[Path], list[str]]:
    """Train, killed by sig while its tokens are half written; then the same command again."""

    def build(tmp: Path) -> list[str]:
        args = train_with("--tokenizer", str(ranks_file(tmp)), text=big_text(tmp))(tmp)
        proc = subprocess.run(
            [sys.executable, "-c", KILLED_WHILE_TOKENIZING, str(int(sig)), *args],
            cwd=ROOT, env=child_env(tmp), capture_output=True, text=True, timeout=TIME_LIMIT,
        )  # fmt: skip
        assert proc.returncode == -sig, proc.stderr
        assert list((tmp / "cache").rglob(".*.tmp")), "the killed writer left no temp file to clean"
        return args

    return build


def garbage_cache(tmp: Path) -> list[str]:
    """Train once, then fill the token cache with random bytes of the same size."""
    args = train_with("--tokenizer", "char")(tmp)
    assert minigpt(tmp, args).returncode == 0
    for tokens in (tmp / "cache" / "tokens").glob("*/chunk-000000.bin"):  # the file's two spans
        tokens.write_bytes(np.random.default_rng(0).bytes(tokens.stat().st_size))
    return args


def fifo_cache(tmp: Path) -> list[str]:
    """Train once, then swap the token cache file for a FIFO."""
    args = train_with("--tokenizer", "char")(tmp)
    assert minigpt(tmp, args).returncode == 0
    for tokens in (tmp / "cache" / "tokens").glob("*/chunk-000000.bin"):  # the file's two spans
        tokens.unlink()
        os.mkfifo(tokens)
    return args


def hf_dir(tmp: Path, *drop: str) -> Path:
    """A Hugging Face GPT-2 directory exported from (a copy of) the bpe fixture run, without the files named
    in drop."""
    from minigpt.convert.hf import to_hf

    shutil.copytree(FIXTURES / "run-v0.1-bpe", tmp / "run")  # exporting notes the export in the run
    to_hf(tmp / "run", tmp / "hf")
    for name in drop:
        (tmp / "hf" / name).unlink()
    return tmp / "hf"


def from_hf(src: Path) -> list[str]:
    return ["convert", "from-hf", str(src), str(src.parent / "out")]


def sharded(shard_name: Callable[[Path], str], link: bool = False) -> Callable[[Path], list[str]]:
    """An HF directory whose weights moved out of it, and a shard index naming them as shard_name(tmp);
    with link, the index names a symlink inside the directory that points at the moved file."""

    def build(tmp: Path) -> list[str]:
        from minigpt.common.files import safetensors_shapes

        src = hf_dir(tmp)
        outside = tmp / "outside.safetensors"
        (src / "model.safetensors").rename(outside)
        name = shard_name(tmp)
        if link:
            (src / name).symlink_to(outside)
        weight_map = dict.fromkeys(safetensors_shapes(outside), name)
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return from_hf(src)

    return build


def deeply_nested_index(tmp: Path) -> list[str]:
    src = hf_dir(tmp, "model.safetensors")
    (src / "model.safetensors.index.json").write_text("[" * 100_000)
    return from_hf(src)


def vocab_linked_out(tmp: Path) -> list[str]:
    """GPT-2 tokenizer files whose vocab.json is a symlink to a file outside the directory."""
    src = hf_dir(tmp, "tokenizer.json")
    (tmp / "elsewhere.json").write_text("{}")
    (src / "vocab.json").symlink_to(tmp / "elsewhere.json")
    (src / "merges.txt").write_text("#version: 0.2\n")
    return from_hf(src)


def hf_fast_tokenizer(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], list[str]]:
    """An HF directory whose only tokenizer file is a byte-level BPE tokenizer.json that change edits."""

    def build(tmp: Path) -> list[str]:
        from minigpt.tokenizer.hf import bytes_to_unicode

        src = hf_dir(tmp, "tokenizer.json")
        vocab = {c: b for b, c in bytes_to_unicode().items()}
        data = {
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
            "added_tokens": [],
        }
        change(data)
        (src / "tokenizer.json").write_text(json.dumps(data))
        return from_hf(src)

    return build


def hub_snapshot(tmp: Path) -> list[str]:
    """An HF directory laid out as huggingface_hub caches it: snapshots/REV/* are links to ../../blobs/."""
    exported = hf_dir(tmp)
    repo = tmp / "models--tiny-gpt2"
    (repo / "blobs").mkdir(parents=True)
    src = repo / "snapshots" / "0123abcd"
    src.mkdir(parents=True)
    for file in exported.iterdir():
        file.rename(repo / "blobs" / file.name)
        (src / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    return from_hf(src)


def minigpt_tokenizer_linked_out(tmp: Path) -> list[str]:
    """minigpt 0.1's export of a bpe run (minigpt_tokenizer.json), the file a symlink out of the directory."""
    src = hf_dir(tmp, "tokenizer.json")
    shutil.copy(FIXTURES / "run-v0.1-bpe" / "tokenizer.json", tmp / "elsewhere.json")
    (src / "minigpt_tokenizer.json").symlink_to(tmp / "elsewhere.json")
    return from_hf(src)


def surrogate_text(tmp: Path) -> list[str]:
    """Text whose unicode_escape decoding holds a lone surrogate."""
    text = tmp / "escaped.txt"
    text.write_bytes(CORPUS.read_bytes() + b"\\udc80\n")
    return train_with("--encoding", "unicode_escape", "--tokenizer", "bpe", text=text)(tmp)


def run_copy(tmp: Path, fixture: str = "run-v0.1-char") -> Path:
    shutil.copytree(FIXTURES / fixture, tmp / "run")
    return tmp / "run"


def with_run(change: Callable[[Path], Any], *command: str) -> Callable[[Path], list[str]]:
    """A copy of the char fixture run that `change` tampers with, then `command` on it ({run} is its path)."""

    def build(tmp: Path) -> list[str]:
        run = run_copy(tmp)
        change(run)
        return [part.replace("{run}", str(run)) for part in command]

    return build


def edit_config(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def tamper(run: Path) -> None:
        config = json.loads((run / "config.json").read_text())
        change(config)
        (run / "config.json").write_text(json.dumps(config))

    return tamper


def replace_with_fifo(name: str) -> Callable[[Path], None]:
    def tamper(run: Path) -> None:
        (run / name).unlink()
        os.mkfifo(run / name)

    return tamper


def write_file(name: str, text: str) -> Callable[[Path], None]:
    return lambda run: (run / name).write_text(text)


GENERATE = ("generate", "-m", "{run}", "-n", "3", "x")


def additive_run_claiming(block_size: int) -> Callable[[Path], list[str]]:
    """A run of a tiny rotary model with the additive score (its weights do not depend on the block size),
    whose config.json then claims `block_size` positions: the weights match, the memory estimate refuses."""

    def build(tmp: Path) -> list[str]:
        from minigpt.model.config import GPTConfig
        from minigpt.model.gpt import GPT
        from minigpt.runs.folder import RunDir
        from minigpt.tokenizer.char import CharTokenizer

        config = GPTConfig(
            vocab_size=26, block_size=32, n_layer=2, n_head=2, n_embd=32, pos="rope", attn_score="additive"
        )
        run = tmp / "run"
        RunDir(run).save(GPT(config), CharTokenizer([chr(97 + i) for i in range(26)]), extra={})
        edit_config(lambda c: c["model"].update(block_size=block_size))(run)
        return [part.replace("{run}", str(run)) for part in GENERATE]

    return build


BILLION_LAYERS = edit_config(lambda c: c["model"].update(n_layer=10**9))


def trained_then(tamper: Callable[[Path], Any], *extra: str) -> Callable[[Path], list[str]]:
    """A run trained for 2 steps here, `tamper`ed, then `train --resume` on it."""

    def build(tmp: Path) -> list[str]:
        run = tmp / "out"
        proc = minigpt(tmp, train_with("--max-iters", "2")(tmp))
        assert proc.returncode == 0, proc.stderr
        tamper(run)
        return ["train", "--resume", str(run), "--max-iters", "4", *extra]

    return build


def trained_with(options: tuple[str, ...], *command: str) -> Callable[[Path], list[str]]:
    """A run trained for 1 step here with `options`, then `command` on it ({run} is its path)."""

    def build(tmp: Path) -> list[str]:
        proc = minigpt(tmp, train_with(*options)(tmp))
        assert proc.returncode == 0, proc.stderr
        return [part.replace("{run}", str(tmp / "out")) for part in command]

    return build


def edit_state(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    """Rewrite state.safetensors with `change` applied to its tensors (torch is fine in the test)."""

    def tamper(run: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        with safe_open(str(run / "state.safetensors"), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(run / "state.safetensors"))
        change(tensors)
        save_file(tensors, str(run / "state.safetensors"), metadata=meta)

    return tamper


def short_moment(tensors: dict[str, Any]) -> None:
    key = next(k for k in tensors if k.endswith("wte.weight/exp_avg"))  # AdamW's, with Muon or without
    tensors[key] = tensors[key][:1].clone()


def short_momentum(tensors: dict[str, Any]) -> None:
    key = next(k for k in tensors if k.endswith("mlp.c_fc.weight/momentum_buffer"))  # Muon's (the default)
    tensors[key] = tensors[key][:, :1].clone()


def metrics_linked_out(run: Path) -> None:
    """metrics.jsonl as a link to a file outside the test's folder: a resume must not append to it (it
    replaces the link with a file of its own, and the snapshot shows the target untouched)."""
    target = run.parent.parent / f"precious-{run.parent.name}.txt"
    target.write_text("do not touch\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(target)


def nan_weights(run: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v.clone().fill_(float("nan")) for k, v in load_file(str(run / "model.safetensors")).items()}
    save_file(tensors, str(run / "model.safetensors"), metadata={"format": "minigpt-run"})


def b64(token: bytes) -> str:
    return base64.b64encode(token).decode()


# ---------------------------------------------------------------------------------------------- the attacks


def chat_jsonl(tmp: Path, *extra: str) -> Path:
    """Conversations in the char fixture's characters (prompt and completion: halves of corpus lines), then
    the `extra` lines."""
    lines = [line.split(" ") for line in CORPUS.read_text(encoding="utf-8").splitlines()[:40]]
    records = [json.dumps({"prompt": " ".join(w[:2]), "completion": " ".join(w[2:4]) or "a"}) for w in lines]
    path = tmp / "chat.jsonl"
    path.write_text("\n".join([*records, *extra]) + "\n", encoding="utf-8")
    return path


def fine_tune(*options: str, chat: Callable[[Path], Path] = chat_jsonl) -> Callable[[Path], list[str]]:
    """`train --init-from` (a copy of the char fixture run) on conversations."""

    def build(tmp: Path) -> list[str]:
        base = run_copy(tmp)
        return ["train", "--init-from", str(base), str(chat(tmp)), "--max-iters", "1", "--eval-iters", "1",
                "--batch-size", "2", "--device", "cpu", "--out", str(tmp / "out"), *options]  # fmt: skip

    return build


def lora_then(tamper: Callable[[Path], Any], *command: str) -> Callable[[Path], list[str]]:
    """A LoRA run trained here on the char fixture, `tamper`ed, then `command` ({run}: the LoRA run)."""

    def build(tmp: Path) -> list[str]:
        proc = minigpt(tmp, fine_tune("--lora-rank", "2")(tmp))
        assert proc.returncode == 0, proc.stderr
        tamper(tmp / "out")
        return [part.replace("{run}", str(tmp / "out")) for part in command]

    return build


def edit_adapter(change: Callable[[dict[str, Any], dict[str, str]], Any]) -> Callable[[Path], None]:
    def tamper(run: Path) -> None:
        from safetensors.numpy import load_file, safe_open, save_file

        with safe_open(str(run / "adapter.safetensors"), framework="np") as f:
            meta = f.metadata()
        tensors = load_file(str(run / "adapter.safetensors"))
        change(tensors, meta)
        save_file(tensors, str(run / "adapter.safetensors"), metadata=meta)

    return tamper


def retrained_base(run: Path) -> None:
    """Point the LoRA run at another base: the fixture with every weight nudged."""
    other = run.parent / "other"
    shutil.copytree(run.parent / "run", other)
    from safetensors.numpy import load_file, save_file

    tensors = {k: v + 0.01 for k, v in load_file(str(other / "model.safetensors")).items()}
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "minigpt-run"})
    edit_config(lambda c: c["adapter"].update(base=str(other)))(run)


CHAT = ("chat", "{run}", "-n", "3")
ATTACKS = [
    Attack(
        "special token id 10**12",
        tampered_run("run-v0.1-bpe", lambda t: t["specials"].update({"<|endoftext|>": 10**12})),
        "tokenizer.json: token id 1000000000000",
    ),
    Attack(
        "special token id -1",
        tampered_run("run-v0.1-bpe", lambda t: t["specials"].update({"<|endoftext|>": -1})),
        "tokenizer.json: token id -1",
    ),
    Attack(
        "special token id true",
        tampered_run("run-v0.1-bpe", lambda t: t["specials"].update({"<|endoftext|>": True})),
        "tokenizer.json: token id True",
    ),
    Attack(
        "a rank past a million unused ids",
        tampered_run("run-v0.1-bpe", lambda t: t["ranks"].extend([None] * 1_000_000 + [b64(b"zzzz")])),
        "unused ids",
    ),
    Attack(
        "one token with two ranks",
        tampered_run("run-v0.1-bpe", lambda t: t["ranks"].__setitem__(298, t["ranks"][65])),
        "has two ranks",
    ),
    Attack(
        "catastrophically backtracking split pattern",
        # lookarounds put tiktoken's regex engine in backtracking mode: this panics, or runs for minutes
        tampered_run("run-v0.1-bpe", lambda t: t.update(pattern=r"(\w+\s?)+(?=!)x"), prompt="a" * 30 + "!"),
        "tokenizer.json: split pattern '(",
    ),
    Attack(
        "empty split pattern",
        tampered_run("run-v0.1-bpe", lambda t: t.update(pattern="")),
        "split pattern ''",
    ),
    Attack(
        "lone surrogate in a char vocabulary",
        tampered_run("run-v0.1-char", lambda t: t.update(chars=[*t["chars"][:-1], "\ud800"])),
        "tokenizer.json: char tokenizer symbol '\\ud800' is a lone surrogate",
    ),
    Attack(
        "two-character symbol in a char vocabulary",
        tampered_run("run-v0.1-char", lambda t: t.update(chars=[*t["chars"][:-1], "ab"])),
        "must be single characters, not 'ab'",
    ),
    Attack(
        "--tokenizer /dev/zero", train_with("--tokenizer", "/dev/zero"), "/dev/zero is not a regular file"
    ),
    Attack("--tokenizer a FIFO", planted(fifo), "ranks.tiktoken is not a regular file"),
    Attack("--tokenizer a directory", planted(lambda tmp: tmp), "is a directory"),
    Attack(
        "--tokenizer a sparse 1 GB .tiktoken file",
        planted(lambda tmp: ranks_file(tmp, size=1 << 30)),
        "ranks.tiktoken is 1,073,741,824 bytes, more than the",
    ),
    Attack(
        "--tokenizer a .tiktoken file with rank 10**12",
        planted(lambda tmp: ranks_file(tmp, extra=f"{b64(b'zzzz')} {10**12}\n")),
        "ranks.tiktoken: token id 1000000000000",
    ),
    Attack(
        "--tokenizer a name too long for the filesystem",
        train_with("--tokenizer", "t" * 300),
        "unknown --tokenizer 'ttt",
        exit_code=2,
    ),
    Attack(
        "training text named too long for the filesystem",
        train_with(text=Path("t" * 300)),
        "File name too long",
    ),
    Attack("training text that is a FIFO", fifo_text, "text.txt is not a regular file"),
    Attack("--encoding bogus", train_with("--encoding", "bogus"), "unknown --encoding 'bogus'", exit_code=2),
    Attack(
        "--encoding base64 (bytes to bytes)",
        train_with("--encoding", "base64"),
        "--encoding 'base64' does not decode bytes to text",
        exit_code=2,
    ),
    Attack(
        "eval --encoding base64",
        lambda tmp: ["eval", str(FIXTURES / "run-v0.1-char"), str(CORPUS), "--encoding", "base64"],
        "--encoding 'base64' does not decode bytes to text",
        exit_code=2,
    ),
    Attack("text that decodes to a lone surrogate", surrogate_text, "gives a lone surrogate (U+DC80)"),
    Attack(
        "same-size garbage in the token cache",
        garbage_cache,
        "fail their check (damaged, incomplete or from an older minigpt): tokenizing again",
        exit_code=0,
    ),
    Attack("a FIFO in the token cache", fifo_cache, "tokenizing again", exit_code=0),
    # the run again: its tokens are written afresh (tokenizing may still go on when the short run ends)
    Attack("kill -9 while tokenizing", killed_while_tokenizing(signal.SIGKILL), "tokeniz", 0),
    Attack("SIGTERM while tokenizing", killed_while_tokenizing(signal.SIGTERM), "tokeniz", 0),
    Attack(
        "HF shard index naming ../",
        sharded(lambda tmp: "../outside.safetensors"),
        "lists the shard '../outside.safetensors', which is not a path inside",
    ),
    Attack(
        "HF shard index naming an absolute path",
        sharded(lambda tmp: str(tmp / "outside.safetensors")),
        "which is not a path inside",
    ),
    Attack(
        "HF shard that is a symlink out of the directory",
        sharded(lambda tmp: "model-00001-of-00001.safetensors", link=True),
        "outside.safetensors, outside",
    ),
    Attack(
        "HF shard index nested 100,000 deep", deeply_nested_index, "model.safetensors.index.json is corrupt"
    ),
    Attack(
        "HF vocab.json that is a symlink out of the directory", vocab_linked_out, "elsewhere.json, outside"
    ),
    Attack(
        "HF minigpt_tokenizer.json that is a symlink out of the directory",
        minigpt_tokenizer_linked_out,
        "elsewhere.json, outside",
    ),
    Attack("(legit) HF hub cache snapshot linking to ../../blobs", hub_snapshot, "wrote", exit_code=0),
    Attack(
        "HF tokenizer.json added token id 10**12",
        hf_fast_tokenizer(lambda t: t["added_tokens"].append({"content": "<|x|>", "id": 10**12})),
        "hf/tokenizer.json: token id 1000000000000",
    ),
    Attack(
        "HF tokenizer.json merges that are not string pairs",
        hf_fast_tokenizer(lambda t: t["model"].update(merges=[[["a"], ["b"]]])),
        "hf/tokenizer.json: a merge is not two tokens",
    ),
    Attack(
        "config.json claims 10**9 layers (numpy engine)",
        with_run(BILLION_LAYERS, *GENERATE, "--backend", "numpy"),
        "holds 2 layers, config says 1,000,000,000",
    ),
    Attack(
        "config.json claims 10**9 layers (torch engine)",
        with_run(BILLION_LAYERS, *GENERATE, "--backend", "torch"),
        "holds 2 layers, config says 1,000,000,000",
    ),
    Attack(
        "config.json claims 10**9 layers (eval)",
        with_run(BILLION_LAYERS, "eval", "{run}", str(CORPUS)),
        "holds 2 layers, config says 1,000,000,000",
    ),
    Attack(
        "config.json 65,536 wide over 32-wide weights (params)",
        with_run(edit_config(lambda c: c["model"].update(n_embd=65536)), "params", "{run}"),
        "transformer.wte.weight has shape [42, 32], config says [42, 65536]",
    ),
    Attack(
        "config.json window_pattern of a million letters",
        with_run(edit_config(lambda c: c["model"].update(window=4, window_pattern="S" * 10**6)), *GENERATE),
        "window_pattern must be letters S (local) and L (full)",
    ),
    Attack(
        "config.json n_kv_head that does not divide n_head",
        with_run(edit_config(lambda c: c["model"].update(n_kv_head=3)), *GENERATE),
        "n_kv_head (3) must divide n_head",
    ),
    Attack(
        "config.json rope_base 1e308 and pos 'alibi'",
        with_run(edit_config(lambda c: c["model"].update(pos="alibi", rope_base=1e308)), *GENERATE),
        "unknown pos 'alibi'",
    ),
    Attack(
        "config.json attn_score 'cosine'",
        with_run(edit_config(lambda c: c["model"].update(attn_score="cosine")), *GENERATE),
        "unknown attn_score 'cosine'",
    ),
    Attack(
        "config.json additive scores over 10**8 positions",
        additive_run_claiming(10**8),
        "GiB of memory",
    ),
    Attack(
        "config.json window past block_size",
        with_run(edit_config(lambda c: c["model"].update(window=10**12)), *GENERATE),
        "must be at most block_size",
    ),
    Attack(
        "config.json nested 100,000 deep",
        with_run(write_file("config.json", "[" * 100_000 + "]" * 100_000), *GENERATE),
        "config.json is corrupt",
    ),
    Attack(
        "model.safetensors is a FIFO",
        with_run(replace_with_fifo("model.safetensors"), *GENERATE),
        "not a regular file",
    ),
    Attack(
        "config.json is a FIFO", with_run(replace_with_fifo("config.json"), *GENERATE), "not a regular file"
    ),
    Attack(
        "model.safetensors header claims a negative dimension",
        with_run(
            lambda run: (run / "model.safetensors").write_bytes(
                (lambda h: len(h).to_bytes(8, "little") + h)(
                    b'{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}'
                )
            ),
            "params",
            "{run}",
        ),
        "negative dimension",
    ),
    Attack(
        "generate -s 10**12 (a KV cache past the machine)",
        with_run(lambda run: None, *GENERATE, "-s", str(10**12)),
        "lower --num-samples",
    ),
    Attack("generate --seed -1", with_run(lambda run: None, *GENERATE, "--seed", "-1"), "--seed"),
    Attack("generate --seed 2**64", with_run(lambda run: None, *GENERATE, "--seed", str(2**64)), "--seed"),
    Attack(
        "an unknown option --temp",
        with_run(lambda run: None, *GENERATE, "--temp", "1"),
        "did you mean --temperature?",
    ),
    Attack(
        "attention --png into /proc",
        with_run(lambda run: None, "attention", "abc", "--model", "{run}", "--png", "/proc/minigpt-x.png"),
        "cannot write /proc/minigpt-x.png",
    ),
    Attack(
        "convert to-hf into /proc",
        with_run(lambda run: None, "convert", "to-hf", "{run}", "/proc/minigpt-x"),
        "/proc/minigpt-x",
    ),
    Attack(
        "state.safetensors with a short AdamW moment (segfaulted inside libtorch)",
        trained_then(edit_state(short_moment)),
        "does not fit its parameter",
    ),
    Attack(
        "state.safetensors with a narrow Muon momentum buffer",
        trained_then(edit_state(short_momentum)),
        "does not fit its parameter",
    ),
    Attack(
        "state.safetensors with a moment for no parameter",
        trained_then(
            edit_state(lambda t: t.update({"optim/transformer.nope/exp_avg": t["rng/torch"].float()}))
        ),
        "belongs to no parameter",
    ),
    Attack(
        "state.safetensors with a bad rng tensor",
        trained_then(edit_state(lambda t: t.update({"rng/torch": t["rng/torch"][:10].clone()}))),
        "random number generator state",
    ),
    Attack(
        "config.json value_embeds as text (numpy engine)",
        with_run(
            edit_config(lambda c: c["model"].update(value_embeds="yes")), *GENERATE, "--backend", "numpy"
        ),
        "value_embeds must be true or false, got 'yes'",
    ),
    Attack(
        "config.json logit_cap as text (torch engine)",
        with_run(edit_config(lambda c: c["model"].update(logit_cap="abc")), *GENERATE, "--backend", "torch"),
        "logit_cap must be a positive number, got 'abc'",
    ),
    Attack(
        "config.json turns skips on without their weights",
        with_run(edit_config(lambda c: c["model"].update(skips=True)), *GENERATE),
        "model.safetensors does not match its config.json (missing skip_weights)",
    ),
    Attack(
        "config.json with an unknown Muon orthogonalizer (resume)",
        trained_then(edit_config(lambda c: c["train"].update(orthogonalizer="bogus"))),
        "unknown orthogonalizer 'bogus'",
    ),
    Attack(
        "config.json with batch_ramp 5 (resume)",
        trained_then(edit_config(lambda c: c["train"].update(batch_ramp=5))),
        "batch_ramp is a fraction of the budget in [0, 1], got 5",
    ),
    Attack(
        "config.json with muon_dtype int8 (resume)",
        trained_then(edit_config(lambda c: c["train"].update(muon_dtype="int8"))),
        "unknown muon_dtype 'int8'",
    ),
    Attack("train --logit-cap 0", train_with("--logit-cap", "0"), "logit_cap must be a positive number"),
    Attack("train --batch-ramp 2", train_with("--batch-ramp", "2"), "batch_ramp is a fraction of the budget"),
    Attack("train --seq-ramp -1", train_with("--seq-ramp", "-1"), "seq_ramp is a fraction of the budget"),
    Attack(
        "config.json with seq_ramp 3 (resume)",
        trained_then(edit_config(lambda c: c["train"].update(seq_ramp=3))),
        "seq_ramp is a fraction of the budget in [0, 1], got 3",
    ),
    Attack("train --skips --n-layer 1", train_with("--skips", "--n-layer", "1"), "(drop --skips)"),
    Attack(
        "convert to-hf of a model with value embeddings and skips",
        trained_with(("--value-embeds", "--skips"), "convert", "to-hf", "{run}", "{run}-hf"),
        "cannot convert to Hugging Face: this model has --value-embeds",
    ),
    Attack("train --lr nan", train_with("--lr", "nan"), "lr must be a finite number, got nan"),
    Attack(
        "train --weight-decay inf",
        train_with("--weight-decay", "inf"),
        "weight_decay must be a finite number",
    ),
    Attack("train --grad-clip nan", train_with("--grad-clip", "nan"), "grad_clip must be a finite number"),
    Attack("train --seed -1", train_with("--seed", "-1"), "seed"),
    Attack(
        "config.json with a tampered train section (lr as text)",
        trained_then(edit_config(lambda c: c["train"].update(lr="abc"))),
        "lr must be a finite number, got 'abc'",
    ),
    Attack(
        "config.json whose train overrides hold a model setting of the wrong type",
        trained_then(edit_config(lambda c: c["train"].update(overrides={"n_layer": "many"}))),
        "n_layer must be an integer, got 'many'",
    ),
    Attack(
        "config.json whose train overrides name no model setting",
        trained_then(edit_config(lambda c: c["train"].update(overrides={"__class__": 1}))),
        "not settings of the model: __class__",
    ),
    Attack(
        "config.json whose train section is a list",
        trained_then(edit_config(lambda c: c.update(train=[1]))),
        "not a JSON object",
    ),
    Attack(
        "metrics.jsonl linked to a file outside the run (resume recovers)",
        trained_then(metrics_linked_out),
        "done: reached max_iters 4",
        exit_code=0,
    ),
    Attack(
        "config.json whose data section points at /etc/passwd (resume)",
        trained_then(edit_config(lambda c: c["data"].update(paths=["/etc/passwd"]))),
        "the text differs from what",
    ),
    Attack(
        "all-NaN weights (attention)",
        with_run(nan_weights, "attention", "abc", "--model", "{run}"),
        "holds NaN or infinite weights",
    ),
    Attack("all-NaN weights (generate)", with_run(nan_weights, *GENERATE), "holds NaN or infinite weights"),
    Attack(
        "train --grad-accum 10**9 under --max-time 10s (gives the step up in time, or takes none)",
        lambda tmp: [
            "train",
            str(CORPUS),
            *TRAIN[:-4],
            "--device",
            "cpu",
            "--grad-accum",
            str(10**9),
            "--max-time",
            "10s",
            "--max-iters",
            "5",
            "--out",
            str(tmp / "out"),
        ],
        "after 0 steps",  # "reached max_time within a step", or before it when start-up took the time
        exit_code=0,
    ),
]


ATTACKS += [
    Attack(
        "conversation JSONL nested past reason",
        fine_tune(chat=lambda tmp: chat_jsonl(tmp, "[" * 100_000)),
        "chat.jsonl:41: not a JSON record",
    ),
    Attack(
        "conversation JSONL with a 17 MB line",
        fine_tune(chat=lambda tmp: chat_jsonl(tmp, '{"prompt": "' + "a" * (17 << 20) + '"}')),
        "chat.jsonl:41: the line is longer than 16 MB",
    ),
    Attack(
        "conversation JSONL with a record longer than the context",
        fine_tune(chat=lambda tmp: chat_jsonl(tmp, json.dumps({"prompt": "a " * 40, "completion": "b"}))),
        "chat.jsonl:41: the conversation is 85 tokens, more than the model's context of 32",
    ),
    Attack(
        "conversation JSONL that is a FIFO",
        fine_tune(chat=lambda tmp: (os.mkfifo(tmp / "c.jsonl"), tmp / "c.jsonl")[1]),
        "c.jsonl is not a regular file",
    ),
    Attack("train --lora-rank 0", fine_tune("--lora-rank", "0"), "lora_rank must be from 1 to 4096"),
    Attack(
        "train --lora-targets q_proj", fine_tune("--lora-rank", "2", "--lora-targets", "q_proj"), "q_proj"
    ),
    Attack(
        "a LoRA run whose base was retrained",
        lora_then(retrained_base, *CHAT),
        "trained on other base weights",
    ),
    Attack(
        "a LoRA run whose base is /etc",
        lora_then(edit_config(lambda c: c["adapter"].update(base="/etc")), *CHAT),
        "the base run /etc of the LoRA run",
    ),
    Attack(
        "an adapter file with a misshapen tensor",
        lora_then(
            edit_adapter(lambda t, m: t.update({k: v[:1] for k, v in t.items() if k.endswith("lora_A")})),
            *GENERATE,
        ),  # fmt: skip
        "does not hold the adapter its settings describe",
    ),
    Attack(
        "an adapter file claiming rank 10**9",
        lora_then(edit_config(lambda c: c["adapter"]["lora"].update(rank=10**9)), *GENERATE),
        "--lora-rank must be an integer from 1 to 4096",
    ),
    Attack(
        "an adapter file of NaN",
        lora_then(edit_adapter(lambda t, m: t.update({k: v * np.nan for k, v in t.items()})), *GENERATE),
        "holds NaN or infinite weights",
    ),
    Attack(
        "an adapter file whose header names another base",
        lora_then(edit_adapter(lambda t, m: m.update(base_sha256="0" * 64)), *GENERATE),
        "describe different adapters",
    ),
    Attack(
        "a LoRA run resumed after its base changed",
        lora_then(retrained_base, "train", "--resume", "{run}", "--max-iters", "2"),
        "trained on other base weights",
    ),
]


# every case is a real process or three: the fast tier runs one, and with it the checker
@pytest.mark.parametrize("attack", slow_but(ATTACKS, "one token with two ranks", ids=lambda a: a.name))
def test_attack_is_refused_cleanly(attack: Attack, tmp_path: Path) -> None:
    check(attack, tmp_path)
