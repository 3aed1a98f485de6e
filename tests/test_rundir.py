"""RunDir, the one owner of the run folder: safe reads and writes of files a stranger may have made."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from minigpt.common.files import atomic_write_bytes, read_json
from minigpt.errors import MinigptError
from minigpt.runs.folder import RunDir

FIXTURE = Path(__file__).parent / "fixtures" / "run-v0.1-char"


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    shutil.copytree(FIXTURE, tmp_path / "run")
    return RunDir(tmp_path / "run")


def test_metrics_are_never_appended_through_a_symlink(run: RunDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run.metrics_path.unlink()
    run.metrics_path.symlink_to(outside)
    with pytest.raises(MinigptError, match="symbolic link"):
        run.append_metrics({"kind": "train", "step": 1})
    assert outside.read_text() == "precious\n"


def test_bad_metrics_lines_are_skipped_with_a_warning(run: RunDir, capsys: pytest.CaptureFixture) -> None:
    good = run.read_metrics()
    with open(run.metrics_path, "a") as f:
        f.write('[1, 2]\n{"kind": "train"}\nnot json\n{"kind": "eval", "step": 99}\n')
    assert run.read_metrics() == [*good, {"kind": "eval", "step": 99}]
    assert "skipped 3 unreadable line(s)" in capsys.readouterr().err
    with open(run.metrics_path, "a") as f:
        f.write('{"kind": "tr')  # a torn last line is what a crash leaves: no warning for it alone
    RunDir(run.path).rewind_metrics(10**9)
    capsys.readouterr()
    with open(run.metrics_path, "a") as f:
        f.write('{"kind": "tr')
    run.read_metrics()
    assert "warning" not in capsys.readouterr().err


def test_rewind_drops_records_after_the_checkpoint(run: RunDir) -> None:
    steps = [r["step"] for r in run.read_metrics()]
    assert max(steps) == 60
    kept = run.rewind_metrics(30)
    assert kept == run.read_metrics() and max(r["step"] for r in kept) == 30


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(run: RunDir) -> None:
    files = sorted(p.name for p in run.path.iterdir())
    with run.lock():
        with pytest.raises(MinigptError, match="being written by another minigpt process"):
            with RunDir(run.path).lock():
                pass
    with RunDir(run.path).lock():  # released on exit
        pass
    assert sorted(p.name for p in run.path.iterdir()) == files  # no lock file left


def test_non_regular_files_and_absurd_json_are_one_line_errors(run: RunDir) -> None:
    run.weights_path.unlink()
    os.mkfifo(run.weights_path)  # opening a FIFO for reading would block forever
    with pytest.raises(MinigptError, match="not a regular file"):
        run.load_model()
    run.config_path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MinigptError, match="is corrupt"):
        run.read_config()


def test_writes_are_public_files_and_failures_are_one_line(tmp_path: Path) -> None:
    atomic_write_bytes(tmp_path / "a.json", b"{}")
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o666 & ~_umask()
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        MinigptError, match=r"cannot write .*file/a.json .*previous a.json, if any, is intact"
    ):
        atomic_write_bytes(tmp_path / "file" / "a.json", b"{}")
    with pytest.raises(MinigptError, match="cannot write"):
        atomic_write_bytes(Path("/proc/minigpt-test.json"), b"{}")


def test_json_out_is_strict(run: RunDir) -> None:
    run.append_metrics({"kind": "eval", "step": 61, "train_loss": float("nan"), "val_loss": float("inf")})
    assert run.read_metrics()[-1] == {"kind": "eval", "step": 61, "train_loss": None, "val_loss": None}
    assert "NaN" not in run.metrics_path.read_text()
    assert read_json(run.config_path)["format"] == "minigpt-run"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _widened(run: RunDir, n_embd: int = 65536) -> RunDir:
    """The run's config.json edited to claim another width than its weights hold."""
    config = read_json(run.config_path)
    config["model"]["n_embd"] = n_embd
    atomic_write_bytes(run.config_path, json.dumps(config).encode())
    return run


@pytest.mark.parametrize(
    "command",
    [
        ["params", "{run}"],
        ["params", "{run}", "--json"],
        ["generate", "-m", "{run}", "-n", "2", "The"],
        ["generate", "-m", "{run}", "-n", "2", "--backend", "torch", "The"],
        ["eval", "{run}", str(FIXTURE.parent / "corpus.txt")],
        ["attention", "The", "--model", "{run}"],
        ["serve", "{run}", "--port", "0"],
        ["convert", "to-hf", "{run}", "{tmp}/hf"],
        ["train", "--resume", "{run}", "--max-iters", "99"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_every_command_that_opens_a_run_refuses_a_config_that_does_not_fit_its_weights(
    runner, run: RunDir, tmp_path: Path, command: list[str]
) -> None:
    """config.json says 65,536 wide, model.safetensors holds 32-wide tensors: one line naming the tensor
    and both shapes, from the header alone (no 51-billion-parameter table, no allocation)."""
    from minigpt.cli.main import app

    if command[0] == "serve":
        pytest.importorskip("fastapi")
    _widened(run)
    args = [part.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for part in command]
    result = runner.invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0] == (
        f"error: {run.weights_path} does not match its config.json (transformer.wte.weight has shape "
        "[42, 32], config says [42, 65536])"
    )
    assert not (tmp_path / "hf").exists()


def test_runs_lists_a_mismatched_run_as_skipped(runner, run: RunDir) -> None:
    from minigpt.cli.main import app

    _widened(run)
    result = runner.invoke(app, ["runs", str(run.path.parent)])
    assert result.exit_code == 0 and "warning: skipped" in result.stderr and "does not match" in result.stderr


def test_the_config_is_checked_against_the_header_alone(run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor is read to compare shapes, and a config claiming a billion layers is refused before its
    tensors are even listed."""
    import minigpt.common.files

    monkeypatch.setattr(
        minigpt.common.files, "load_tensors", lambda *a, **k: pytest.fail("a tensor was read")
    )
    assert run.model_config().n_embd == 32
    with pytest.raises(MinigptError, match=r"holds 2 layers, config says 1,000,000,000"):
        config = read_json(run.config_path)
        config["model"]["n_layer"] = 10**9
        run.model_config(config)
    (run.path / "cfg-only").mkdir()
    (run.path / "cfg-only" / "config.json").write_bytes(run.config_path.read_bytes())
    assert RunDir(run.path / "cfg-only").model_config().n_embd == 32  # no weights yet: nothing to compare


def test_a_run_writes_its_tokenizer_files_once_unless_they_change_or_vanish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minigpt.model.config import GPTConfig
    from minigpt.model.gpt import GPT
    from minigpt.tokenizer import hf as hftokenizer
    from minigpt.tokenizer.char import CharTokenizer

    built: list[int] = []
    real = hftokenizer.tokenizer_json
    monkeypatch.setattr(hftokenizer, "tokenizer_json", lambda tok: built.append(tok.vocab_size) or real(tok))
    tok = CharTokenizer.from_text("hello world")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size + 1, block_size=8, n_layer=1, n_head=1, n_embd=8))
    run = RunDir(tmp_path / "run")
    for _ in range(3):  # a run's checkpoints: the same tokenizer, built and written once
        run.save(model, tok, {})
    assert built == [tok.vocab_size]
    (run.path / RunDir.TOKENIZER).unlink()  # gone: written again
    run.save(model, tok, {})
    chat = tok.with_specials(["<|end|>"], tok.vocab_size)  # another tokenizer: written again
    run.save(model, chat, {})
    RunDir(run.path).save(model, chat, {})  # another writer cannot know what is there
    assert built == [tok.vocab_size] * 2 + [chat.vocab_size] * 2
    assert json.loads((run.path / RunDir.TOKENIZER).read_text())["added_tokens"][-1]["content"] == "<|end|>"
