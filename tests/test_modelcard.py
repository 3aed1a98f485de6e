"""README.md model cards: what a run folder and an export say about the model, the licence left to the
user (and kept), a README.md of the user's own never replaced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from minigpt.cli.main import app
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer


@pytest.mark.slow
def test_a_default_runs_card(default_run: Path) -> None:
    card = (default_run / "README.md").read_text()
    assert card.startswith("---\n# license: choose one") and "library_name: minigpt" in card
    for fact in ("2 layers, 4 heads", "rope positions, rmsnorm, swiglu", "LlamaForCausalLM", "bpe (",
                 "corpus.txt", "30 steps", "nats per token", "bits per byte", "`minigpt train`", "optimizer=muon",
                 "License | not set"):  # fmt: skip
        assert fact in card, fact


def test_the_licence_a_user_sets_is_kept_and_their_own_readme_stays(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text("abc d")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=1, n_embd=8))
    run = RunDir(tmp_path / "run")
    run.save(model, tok, {})
    card = run.path / "README.md"
    card.write_text(card.read_text().replace(card.read_text().splitlines()[1], "license: apache-2.0"))
    run.save(
        model, tok, {"metrics": {"best_val_loss": 1.5, "best_step": 3, "last": {"step": 3, "tokens": 24}}}
    )
    text = card.read_text()
    assert "license: apache-2.0\n" in text and "| License | apache-2.0 |" in text and "1.5000 nats" in text
    card.write_text("# my notes\n")
    run.save(model, tok, {})
    assert card.read_text() == "# my notes\n"


@pytest.mark.slow
def test_an_export_carries_a_card(default_run: Path, tmp_path: Path, runner) -> None:
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    shutil.copytree(default_run, run)
    torch.set_num_threads(1)
    assert runner.invoke(app, ["convert", "to-hf", str(run), str(tmp_path / "hf")]).exit_code == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "library_name: transformers" in card and "`minigpt convert to-hf` of the run" in card
    assert 'pipeline("text-generation", model="hf")' in card and "30 steps" in card
