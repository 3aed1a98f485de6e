"""The demo: train on Python's own reference documentation (shipped with every Python), generate, count; its
settings (`DemoConfig`) are the options of `minigpt demo`."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from minigpt.common.files import atomic_write_bytes
from minigpt.common.settings import check_bounds, setting
from minigpt.errors import MinigptError
from minigpt.train.config import parse_duration

if TYPE_CHECKING:
    from minigpt.train.loop import TrainResult
    from minigpt.train.reporters import ProgressReporter

DEMO_PROMPT = "The "


@dataclass(frozen=True)
class DemoConfig:
    """How long the demo trains, where its run goes, and how much it generates."""

    max_time: str = setting("2m", "Training time budget, e.g. 90s, 2m, 10m.")
    out: Path = setting(Path("checkpoints/demo"), "Run directory for the demo model.")
    tokens: int = setting(300, "Tokens to generate at the end.", min=1)
    seed: int = setting(1337, "Seed for training and sampling.")

    def __post_init__(self) -> None:
        check_bounds(self)
        parse_duration(self.max_time)  # a budget it cannot read is a usage error before anything runs

    @property
    def seconds(self) -> float:
        return parse_duration(self.max_time)


def demo_text() -> str:
    """The text of the language reference topics that `help()` shows (about 450 KB, plain English + code)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise MinigptError(
            "this Python has no pydoc_data (some distributions strip it): train on a file of your own "
            "with `minigpt train FILE`"
        ) from None
    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"


def write_demo_text(path: Path) -> Path:
    """Write the demo corpus to `path` (once; it never changes for a given Python) and return it."""
    data = demo_text().encode("utf-8")
    if not path.is_file() or path.read_bytes() != data:
        atomic_write_bytes(path, data)
    return path


def train_demo(cfg: DemoConfig, reporter: ProgressReporter, overwrite: bool = False) -> TrainResult:
    """Step 1: train the CPU recipe's model on the demo corpus for `cfg.max_time` into `cfg.out`, which
    must not hold a run unless `overwrite`: a run there may be the user's, however it got its name."""
    from minigpt.data.config import default_cache_dir
    from minigpt.data.dataset import DataConfig
    from minigpt.runs.folder import RunDir
    from minigpt.train.loop import TrainConfig, train

    # refused before anything runs, in the demo's own options (train's message names --resume)
    RunDir(cfg.out).guard_new(overwrite, "pass --out DIR for a new one, or --overwrite to replace it")
    corpus = write_demo_text(default_cache_dir() / "demo" / "pydoc_topics.txt")
    seconds = cfg.seconds
    print(f"== 1/3 training on Python's reference documentation ({corpus}) for {seconds:g}s", file=sys.stderr)
    if compile_kernels_meanwhile():
        print("   (compiling the CPU kernels for step 2 in the background meanwhile, once)", file=sys.stderr)
    settings = TrainConfig(max_time=seconds, seed=cfg.seed)
    return train(settings, DataConfig(paths=(corpus,)), out=cfg.out, overwrite=overwrite, reporter=reporter)


def compile_kernels_meanwhile() -> bool:
    """Where step 2 will decode on the NumPy engine and numba's cache lacks its kernels, start compiling
    them in the background now, while the user waits for the training anyway: whether a compile is under
    way. Anything else (a GPU, no numba cache, a compile that failed before) step 2's load says itself."""
    from minigpt.generate.engines import compiling
    from minigpt.generate.load import NUMPY_KV_CACHE, choose_backend

    if choose_backend("auto", "auto", "auto") != "numpy":
        return False
    return compiling.plan("none", NUMPY_KV_CACHE, lambda _: None)[1] is not None


def generate_demo_text(cfg: DemoConfig, out: TextIO) -> None:
    """Step 2: continue DEMO_PROMPT with `cfg.tokens` tokens of `cfg.out`'s model on the engine `minigpt
    generate` would pick, streamed to a terminal."""
    run = cfg.out
    from minigpt.generate.decode import Generation, encode_prompt, write_text
    from minigpt.generate.load import choose_backend, load_engine
    from minigpt.runs.folder import RunDir

    backend = choose_backend("auto", "auto", "auto", weights=RunDir(run).weights_path)
    started = time.perf_counter()
    engine, tokenizer = load_engine(run, backend)
    loaded = time.perf_counter() - started
    ids = encode_prompt(tokenizer, DEMO_PROMPT)
    gen = Generation(engine, tokenizer, ids, max_new_tokens=cfg.tokens, temperature=0.8, seed=cfg.seed)
    write_text(gen, out, stream=out.isatty())
    if not out.isatty():
        out.write("\n")  # a terminal's text already ends with one; keep the table off the text in a file too
    print(gen.summary(loaded), file=sys.stderr)


def show_demo_params(run: Path) -> None:
    """Step 3: the parameter tables of the trained model, with how it was trained."""
    from minigpt.cli.views import print_params, trained_with, training_summary
    from minigpt.model.params import count_params
    from minigpt.runs.folder import RunDir
    from minigpt.runs.summary import summarize

    summary = summarize(RunDir(run))
    report = count_params(RunDir(run).model_config())
    print_params(
        report, summary.path, summary.params, training_summary(summary), optimizer=trained_with(RunDir(run))
    )
