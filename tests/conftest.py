"""Shared fixtures: tiny configs, the optional ../shared data, and a CLI runner."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
R50K_FILE = SHARED_DATA / "r50k_base.tiktoken"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"

# keep tests reproducible and light on the 2-core machines
os.environ.setdefault("OMP_NUM_THREADS", "1")
# training measures nothing on the machine (its dtype and OpenMP spin would follow the speed of the moment):
# tests of that logic fake the timings (tests/test_train_tuning.py)
os.environ.setdefault("MINIGPT_MEASURE", "off")

# The same examples on every run and machine, so a failure CI finds reproduces anywhere (print_blob adds
# the @reproduce_failure line); HYPOTHESIS_PROFILE=default explores new random examples instead.
settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=200, deadline=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def slow_but(values: Iterable[Any], *fast: str, ids: Callable[[Any], str] = str) -> list[Any]:
    """`values` as parameters named by `ids`, each marked slow but those named in `fast`: the fast tier
    (`-m "not slow"`) runs that sample of a sweep, the full suite all of it."""
    params = [pytest.param(v, id=ids(v), marks=() if ids(v) in fast else pytest.mark.slow) for v in values]
    assert set(fast) <= {p.id for p in params}, f"no such case: {set(fast) - {p.id for p in params}}"
    return params


class FakeClock:
    """A clock that moves only when told to: time-dependent code is handed one, so no test depends on how
    fast the machine is that minute."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pytest_report_header() -> list[str]:
    """The versions this run resolved: CI builds a fresh environment, so a failure names today's releases."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "numpy", "numba", "transformers", "tiktoken", "safetensors", "fastapi"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ["versions: " + ", ".join(found)]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token caches go to a per-session temp dir, never the user's ~/.cache."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "minigpt-cache"))


class _Compiled:
    """A compiling process that has finished (`compiling.spawn`'s stand-in in tests)."""

    def poll(self) -> int:
        return 0


def _compile_here(quantize: str, kv_cache: str, folder: Path) -> _Compiled:
    from minigpt.generate.engines import kernels

    if kernels.numba is not None:
        kernels.compile_entries(kernels.missing(kernels.entries(quantize, kv_cache)))
    return _Compiled()


@pytest.fixture(scope="session", autouse=True)
def _default_kernels_compiled() -> None:
    """numba's cache holds the NumPy engine's kernels for a command's defaults (and a float32 KV cache)
    before any test runs: a command a test starts in a subprocess then loads them, where it would leave a
    compiling process behind it (minigpt.generate.engines.compiling)."""
    for kv_cache in ("float16", "float32"):
        _compile_here("none", kv_cache, ROOT)


@pytest.fixture(autouse=True)
def _kernels_compile_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load in this process that finds kernels lacking has them compiled here, at once, not by a process
    that would outlive the test; it still decodes its first generation on the array path."""
    monkeypatch.setattr("minigpt.generate.engines.compiling.spawn", _compile_here)


@pytest.fixture
def runner():
    from typer.testing import CliRunner

    return CliRunner()


@pytest.fixture
def r50k_file() -> Path:
    if not R50K_FILE.is_file():
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    return R50K_FILE


@pytest.fixture
def shakespeare() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is absent")
    return SHAKESPEARE


# Held-out mixed-script text for tokenizer checks: Chinese, English, emoji (with a skin tone and a flag),
# accents, code, digits, contractions, special-token text and runs of spaces, tabs and newlines.
MIXED = (
    "Hello world! 你好，世界。这是一个测试：模型和分词器。 Emoji 🙂👍🏽🇫🇷 and café, naïve Ünïcödé.\n"
    "def f(x):\n    return x ** 2  # square\n\n\n\tif x>0:\t\tpass   \n"
    "日本語のテキスト, Ελληνικά, русский текст; 12345 678.9e-10 it's we'll THEY'VE <|endoftext|>\r\n"
    "   \n  \n x   "
)
# what the default-settings run below learns from: English with some of every script in MIXED
CORPUS = (
    "".join(
        f"{w} the quick brown fox jumps over the lazy dog {i % 13}, said {w!r}.\n"
        for i, w in enumerate(["alpha", "beta", "gamma", "delta", "你好", "世界", "café", "🙂"] * 60)
    )
    + "def square(x):\n    return x ** 2\n\n\t\ttabs\n"
    + MIXED[::-1]
)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run `minigpt train FILE` makes with every default (the CPU recipe: bpe 512 tokenizer, the modern
    architecture, Muon), only its budget short: 30 steps."""
    from typer.testing import CliRunner

    from minigpt.cli.main import app

    tmp = tmp_path_factory.mktemp("default-run")
    (tmp / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    out = tmp / "run"
    args = ["train", str(tmp / "corpus.txt"), "--max-iters", "30", "--eval-iters", "2", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out
