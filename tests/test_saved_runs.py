"""Runs saved by minigpt 0.1 (tests/fixtures) still load, generate the same greedy text and score the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = FIXTURES / "corpus.txt"

# produced by minigpt 0.1 (commit d41956f) from these very files, before the code was restructured
GREEDY = {
    "char": " wie qumpin wick wick wiebrog wie wily qumpily wiebrog wiebrog wiebrog wiebrog w",
    "bpe": " lazy" * 26 + " l",
}
EVAL = {
    "char": dict(loss=1.7013775549310248, bits_per_byte=2.4545689611787793, tokens=31712, bytes=31712),
    "bpe": dict(loss=2.3494993021728794, bits_per_byte=1.4930811567162119, tokens=13952, bytes=31674),
}


def minigpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minigpt", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_old_run_generates_the_same_greedy_text(kind: str, backend: str) -> None:
    """80 tokens from a block-32 model: past the context window, so the slide policy is covered too."""
    run = FIXTURES / f"run-v0.1-{kind}"
    proc = minigpt(
        "generate", "-m", str(run), "-t", "0", "-n", "80", "--backend", backend, "--json", "The quick"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["samples"][0]["text"] == GREEDY[kind]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_old_run_scores_the_same(kind: str) -> None:
    proc = minigpt("eval", str(FIXTURES / f"run-v0.1-{kind}"), str(CORPUS), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key, value in EVAL[kind].items():
        assert result[key] == pytest.approx(value, rel=1e-6), key
