"""Long phases show progress on stderr: `minigpt eval`'s loading, reading and scoring, a bpe tokenizer's
merging after its reading, the convert commands' loading and writing; counted work with a bar, the rest with
a spinner and the time so far on a terminal; plain status lines elsewhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, FakeClock
from test_corpus import doc, write_corpus
from test_finetune import base_run, chat_file, lora_run  # noqa: F401  (fixtures)

from minigpt.analysis.eval_config import EvalConfig
from minigpt.analysis.evaluate import evaluate_run
from minigpt.cli.main import app
from minigpt.convert.config import MergeConfig
from minigpt.convert.hf import from_hf, to_hf
from minigpt.corpus.progress import Meter, Progress, text_size
from minigpt.data.dataset import DataConfig, find_inputs, prepare_tokenizer
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer
from minigpt.train.finetune import merge_run

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide enough for the temp paths the labels name (rich reads the width from COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "400")


def terminal() -> tuple[Progress, io.StringIO]:
    """A Progress drawing on a fake terminal, and what it drew."""
    out = io.StringIO()
    return Progress(True, stream=out, terminal=True), out


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    """An untrained char model saved as a run: enough to load, score and export."""
    run = tmp_path / "run"
    # ids past the characters: an end-of-text id for llama.cpp (minigpt.convert.to_gguf)
    model = GPT(GPTConfig(vocab_size=len(CHARS) + 4, block_size=16, n_layer=1, n_head=2, n_embd=16))
    RunDir(run).save(model, CharTokenizer(CHARS), {})
    return run


def test_a_meter_says_how_far_counted_work_is_and_how_long_the_rest_has_taken() -> None:
    clock = FakeClock()
    scoring = Meter("scoring", 200, clock, unit="windows")
    scoring(50)
    clock.now += 10
    assert scoring.status() == "scoring: 50 of 200 windows (25%), 0:30 left"
    writing = Meter("writing out.gguf", 0, clock)
    clock.now += 12
    assert writing.status() == "writing out.gguf: 0:12 so far"


def test_on_a_terminal_counted_work_gets_a_bar_and_the_rest_a_spinner() -> None:
    progress, out = terminal()
    with progress.phase("scoring", 4, unit="windows") as meter:
        meter(4)
    with progress.phase("writing model.safetensors"):
        pass
    drawn = out.getvalue()
    assert "scoring" in drawn and "4/4" in drawn and "windows" in drawn
    assert (
        "writing model.safetensors" in drawn and "0:00:00" in drawn and "━" not in drawn.split("scoring")[0]
    )


def test_eval_shows_its_loading_reading_and_scoring(tiny_run: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 40)
    progress, out = terminal()
    result = evaluate_run(tiny_run, [text], EvalConfig(batch_size=4), "cpu", progress=progress)
    drawn = out.getvalue()
    assert f"loading {tiny_run}" in drawn and f"reading and tokenizing {text}" in drawn
    assert f"{result.windows}/{result.windows}" in drawn and "windows" in drawn


@pytest.mark.slow
def test_minigpt_eval_draws_progress_on_a_terminal_and_keeps_stdout_for_the_table(
    tiny_run: Path, tmp_path: Path
) -> None:
    """stderr is a terminal, stdout a pipe: the bar goes to the terminal, the table alone to the pipe."""
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 200)
    main, follower = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minigpt", "eval", str(tiny_run), str(text), "--json"],
        stdout=subprocess.PIPE, stderr=follower, cwd=ROOT, env={**os.environ, "TERM": "xterm"},
    )  # fmt: skip
    os.close(follower)
    stdout, _ = proc.communicate(timeout=120)
    drawn = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the process has gone and the terminal is drained
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main)
    assert proc.returncode == 0, drawn
    assert b"scoring" in drawn and b"windows" in drawn
    assert stdout.decode().startswith("{") and b"scoring" not in stdout


def test_a_bpe_tokenizer_shows_its_merging_once_its_reading_is_done(tmp_path: Path) -> None:
    """The reading bar counts bytes on disk; the merging that follows (which reports nothing) is a phase of
    its own, not a full bar standing still; the note says the size of the text, not of the compressed file."""
    path = write_corpus(tmp_path / "a.txt", [doc(i, 200) for i in range(60)], compression="zst")
    config = DataConfig(paths=(path,), tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache")
    progress, out = terminal()
    notes: list[str] = []
    progress.note = notes.append  # type: ignore[method-assign]
    tok = prepare_tokenizer(config, find_inputs(config, False), progress)
    drawn = out.getvalue()
    assert "training bpe tokenizer (300 tokens)" in drawn
    text = text_size(sum(len(doc(i, 200).encode()) for i in range(60)))  # the documents, one a line
    assert f"merging pairs of {text} of text" in drawn
    disk = text_size(path.stat().st_size)
    assert text != disk and notes[-1].startswith(
        f"training bpe tokenizer (300 tokens): {tok.describe()} from {text} of text ({disk} of files on disk) in "
    ), notes


def test_the_convert_commands_show_their_loading_and_writing(tiny_run: Path, tmp_path: Path) -> None:
    progress, out = terminal()
    to_hf(tiny_run, tmp_path / "hf", progress=progress)
    drawn = out.getvalue()
    assert f"loading {tiny_run}" in drawn and "building the tokenizer files" in drawn
    assert f"writing {tmp_path / 'hf' / 'model.safetensors'}" in drawn
    progress, out = terminal()
    from_hf(tmp_path / "hf", tmp_path / "back", progress=progress)
    drawn = out.getvalue()
    assert f"reading the weights of {tmp_path / 'hf'}" in drawn and f"writing {tmp_path / 'back'}" in drawn


def test_to_gguf_counts_the_tensors_it_converts(tiny_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from minigpt.convert.config import GGUFConfig
    from minigpt.convert.to_gguf import to_gguf

    progress, out = terminal()
    result = to_gguf(tiny_run, tmp_path / "m.gguf", GGUFConfig(dtype="q8_0"), progress=progress)
    drawn = out.getvalue()
    count = len(RunDir(tiny_run).load_weights(result.config))
    assert f"loading {tiny_run}" in drawn and "converting the tensors to q8_0" in drawn
    assert f"{count}/{count}" in drawn and "tensors" in drawn and f"writing {tmp_path / 'm.gguf'}" in drawn


def test_merge_shows_its_loading_and_writing(lora_run: Path, tmp_path: Path) -> None:  # noqa: F811
    progress, out = terminal()
    merge_run(lora_run, MergeConfig(out=tmp_path / "merged"), progress=progress)
    drawn = out.getvalue()
    assert f"loading {lora_run} and its base" in drawn and f"writing {tmp_path / 'merged'}" in drawn


def test_eval_keeps_openmp_threads_from_spinning(
    runner, tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As train and generate do: OpenMP's threads sleep soon after a parallel region, so scoring's forward
    passes do not wait on threads spinning on the cores they need (on a busy machine, several times slower)."""
    monkeypatch.setenv("GOMP_SPINCOUNT", "")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 40)
    result = runner.invoke(app, ["eval", str(tiny_run), str(text), "--json"])
    assert result.exit_code == 0, result.output
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
