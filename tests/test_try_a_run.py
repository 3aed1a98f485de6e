"""How a run says to try it: the `generate with:` line after training and the model card's "Use" commands
run as printed, in a shell, from the folder the run was trained in, on a model that knows only its text."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.runs.folder import RunDir
from minigpt.runs.usage import FALLBACK_PROMPT, example_prompt, generate_command, opening
from minigpt.tokenizer.char import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent
# no capital letter at all, so the char tokenizer cannot encode "Once upon a time"; quotes to quote
TEXT = "it's the cat's \"hat\", she said\n" + "the quick brown fox jumps over the lazy dog.\n" * 60
OUT = "my runs/cat"  # relative to where it was trained, with a space to quote


def _in_shell(line: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a printed `minigpt ...` line through sh in `cwd`, this checkout's minigpt standing in for the
    installed command; `extra` options are appended (a short, torch-engine generation)."""
    minigpt = shlex.join([sys.executable, "-m", "minigpt"])
    assert line.startswith("minigpt ")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = f"{minigpt}{line.removeprefix('minigpt')} {shlex.join(extra)}"
    return subprocess.run(["sh", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A char run trained in a folder of its own (`minigpt train` in a real process there) and its stderr."""
    where = tmp_path_factory.mktemp("project")
    (where / "story.txt").write_text(TEXT, encoding="utf-8")
    args = ["train", "story.txt", "--tokenizer", "char", "--preset", "tiny", "--batch-size", "4",
            "--max-iters", "2", "--eval-iters", "1", "--device", "cpu", "--out", OUT]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "minigpt", *args], cwd=where, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return where, done.stderr


@pytest.mark.slow
def test_the_generate_hint_after_training_runs_as_printed(trained: tuple[Path, str]) -> None:
    where, stderr = trained
    hint = next(line for line in stderr.splitlines() if line.startswith("generate with: "))
    line = hint.removeprefix("generate with: ")
    assert shlex.split(line) == ["minigpt", "generate", "--model", OUT, "it's the cat's \"hat\","]
    done = _in_shell(line, where, "-n", "5", "--backend", "torch", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) == 5 and set(done.stdout) <= set(TEXT)


@pytest.mark.slow
def test_the_model_cards_commands_run_from_where_the_run_was_trained(trained: tuple[Path, str]) -> None:
    where, _ = trained
    card = (where / OUT / RunDir.CARD).read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", card, re.S)
    assert block is not None, card
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    assert len(lines) == 3 and all(shlex.split(line)[3] == OUT for line in lines)
    generated = _in_shell(lines[0], where, "-n", "5", "--backend", "torch", "--seed", "1")
    assert generated.returncode == 0, generated.stderr
    # to-hf (to-gguf takes the same paths; llama.cpp's vocabulary cannot hold this char tokenizer)
    converted = _in_shell(lines[1], where)
    assert converted.returncode == 0, converted.stderr
    assert (where / f"{OUT}-hf" / "config.json").is_file()
    assert f'from_pretrained("{OUT}")' in card


def test_the_opening_is_the_first_line_with_words_cut_at_a_space() -> None:
    assert opening("\n\n  First Citizen:\nBefore we proceed") == "First Citizen:"
    assert opening("Before we proceed any further, hear me speak.") == "Before we proceed any"
    assert opening("- item one\n") == "item one"  # a prompt starting with "-" would read as an option
    assert opening("x" * 40) == "x" * 24
    assert opening("<|endoftext|>second document") == ""  # the first document is empty
    assert opening("") == ""


def test_the_example_prompt_is_always_one_the_tokenizer_encodes() -> None:
    lower = CharTokenizer.from_text("the cat sat on the mat\n")
    assert example_prompt(lower, "the cat sat on the mat\n") == "the cat sat on the mat"
    assert example_prompt(lower) == "a"  # no "O": not the fallback, but the vocabulary's first letter
    assert example_prompt(CharTokenizer.from_text("Once upon a time, not again")) == FALLBACK_PROMPT
    assert example_prompt(lower, "\ufffdcut") != "\ufffdcut"  # a character cut by decoding a prefix


def test_the_generate_command_quotes_for_the_shell() -> None:
    line = generate_command(Path("my runs/it's"), 'say "hi"; rm -rf x')
    assert shlex.split(line) == ["minigpt", "generate", "--model", "my runs/it's", 'say "hi"; rm -rf x']
    assert generate_command(Path("checkpoints/input"), "") == "minigpt generate --model checkpoints/input"
