"""The demo: train on Python's own reference documentation (shipped with every Python), generate, count."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from minigpt.errors import MinigptError
from minigpt.files import atomic_write_bytes

if TYPE_CHECKING:
    from minigpt.reporters import ProgressReporter
    from minigpt.train import TrainResult

DEMO_PROMPT = "The "


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


def train_demo(out: Path, seconds: float, seed: int, reporter: ProgressReporter) -> TrainResult:
    """Step 1: train the CPU recipe's model on the demo corpus for `seconds`, replacing `out`."""
    from minigpt.data import DataConfig
    from minigpt.dataconfig import default_cache_dir
    from minigpt.train import TrainConfig, train

    corpus = write_demo_text(default_cache_dir() / "demo" / "pydoc_topics.txt")
    print(f"== 1/3 training on Python's reference documentation ({corpus}) for {seconds:g}s", file=sys.stderr)
    cfg = TrainConfig(max_time=seconds, seed=seed)
    return train(cfg, DataConfig(paths=(corpus,)), out=out, overwrite=True, reporter=reporter)


def generate_demo_text(run: Path, tokens: int, seed: int, out: TextIO) -> None:
    """Step 2: continue DEMO_PROMPT on the engine `minigpt generate` would pick, streamed to a terminal."""
    from minigpt.decode import Generation, encode_prompt, write_text
    from minigpt.engines import choose_backend, load_engine
    from minigpt.rundir import RunDir

    backend = choose_backend("auto", "auto", "auto", weights=RunDir(run).weights_path)
    engine, tokenizer = load_engine(run, backend)
    ids = encode_prompt(tokenizer, DEMO_PROMPT)
    gen = Generation(engine, tokenizer, ids, max_new_tokens=tokens, temperature=0.8, seed=seed)
    write_text(gen, out, stream=out.isatty())
    if not out.isatty():
        out.write("\n")  # a terminal's text already ends with one; keep the table off the text in a file too
    print(gen.summary(), file=sys.stderr)


def show_demo_params(run: Path) -> None:
    """Step 3: the parameter tables of the trained model, with how it was trained."""
    from minigpt.params import count_params
    from minigpt.rundir import RunDir
    from minigpt.runs import summarize
    from minigpt.views import print_params, training_summary

    summary = summarize(RunDir(run))
    report = count_params(RunDir(run).model_config())
    print_params(report, summary.path, summary.params, training_summary(summary))
