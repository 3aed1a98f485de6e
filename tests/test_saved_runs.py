"""Runs saved by minigpt 0.1 (tests/fixtures) still load, generate the same greedy text and score the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import slow_but

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = FIXTURES / "corpus.txt"

# produced by minigpt 0.1 (commit d41956f) from these very files, before the code was restructured; the
# modern run (every architecture option at once, trained and measured at f961398, the commit before the move
# into packages) by `minigpt train tests/fixtures/corpus.txt --tokenizer char --n-layer 2 --n-head 4
# --n-embd 32 --block-size 32 --arch modern --qk-norm --n-kv-head 2 --window 8 --window-pattern SL
# --value-embeds --skips --logit-cap 15 --attn-score general --max-iters 60`
GREEDY = {
    "run-v0.1-char": " wie qumpin wick wick wiebrog wie wily qumpily wiebrog wiebrog wiebrog wiebrog w",
    "run-v0.1-bpe": " lazy" * 26 + " l",
    "run-v0.1.0-modern": " bold while wizards brown brown wizards brown brown while while while wizards br",
}
EVAL = {
    "run-v0.1-char": dict(
        loss=1.7013775549310248, bits_per_byte=2.4545689611787793, tokens=31712, bytes=31712
    ),
    "run-v0.1-bpe": dict(
        loss=2.3494993021728794, bits_per_byte=1.4930811567162119, tokens=13952, bytes=31674
    ),
    "run-v0.1.0-modern": dict(loss=0.6971573141581114, bits_per_byte=1.0057853998553765, tokens=31712),
}


def minigpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minigpt", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("run", slow_but(GREEDY, "run-v0.1.0-modern"))
def test_old_run_generates_the_same_greedy_text(run: str, backend: str) -> None:
    """80 tokens from a block-32 model: past the context window, so the slide policy is covered too."""
    model = str(FIXTURES / run)
    proc = minigpt(
        "generate", "-m", model, "-t", "0", "-n", "80", "--backend", backend, "--json", "The quick"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["samples"][0]["text"] == GREEDY[run]


@pytest.mark.slow
@pytest.mark.parametrize("run", EVAL)
def test_old_run_scores_the_same(run: str) -> None:
    proc = minigpt("eval", str(FIXTURES / run), str(CORPUS), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key, value in EVAL[run].items():
        assert result[key] == pytest.approx(value, rel=1e-6), key
