"""Tokenizing a corpus ahead of training: what `minigpt prepare` runs, and what it tells `train` to reuse.

Under torchrun the processes of each machine split the files between them and tokenize into the shared
store; then every process waits for the whole corpus, so each finishes with everything in place.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from minigpt.corpus.ingest import Share
from minigpt.corpus.progress import Progress, text_size
from minigpt.data.dataset import DataConfig, find_inputs, prepare_data, prepare_tokenizer, tokenizer_path


@dataclass(frozen=True)
class Prepared:
    """What `prepare` left in the store for `train` to reuse."""

    tokenizer: str  # described
    tokenizer_file: Path | None  # the learned tokenizer in the cache (None: a fixed vocabulary)
    files: int
    text_bytes: int
    train_tokens: int
    val_tokens: int
    val_bytes: int
    store: Path
    seconds: float
    master: bool = True  # rank 0, or the only process: the one that reports

    def describe(self) -> str:
        where = f" ({self.tokenizer_file})" if self.tokenizer_file else ""
        return (
            f"prepared {self.files} file(s) in {self.seconds:.1f}s: {text_size(self.text_bytes)} of text -> "
            f"{self.train_tokens + self.val_tokens:,} tokens ({self.train_tokens:,} train, {self.val_tokens:,} "
            f"validation: {text_size(self.val_bytes)}) in {self.store}\ntokenizer: {self.tokenizer}{where}\n"
            f"`minigpt train` with the same files and data options reuses all of it and starts at once"
        )


def prepare(config: DataConfig, progress: bool = True, block_size: int = 1) -> Prepared:
    """Stamp the inputs, learn the tokenizer and tokenize `config`'s corpus into the store (this process's share of it
    under torchrun), then wait until all of it is there."""
    started = time.perf_counter()
    dist = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torch loads only under torchrun
        from minigpt.train.distributed import DistContext

        dist = DistContext.from_env("cpu")
    master = dist is None or dist.is_master
    report = Progress(progress and master)
    share = Share(dist.local_rank, dist.local_world_size) if dist is not None else Share()
    inputs = find_inputs(config, report, share)
    with dist.master_first() if dist is not None else contextlib.nullcontext():
        tokenizer = prepare_tokenizer(config, inputs, report)  # one process per machine learns it
    dataset = prepare_data(config, block_size, tokenizer, report, share=share, inputs=inputs)
    while not dataset.train.complete:  # the other processes' files
        dataset.train.refresh(wait=True)
    _, text = dataset.ingest.totals() if dataset.ingest is not None else (0, 0)
    if dist is not None:
        dist.barrier()
        dist.close()
    return Prepared(
        tokenizer=tokenizer.describe(),
        tokenizer_file=tokenizer_path(config, inputs),
        files=len(inputs.train) + len(inputs.val),
        text_bytes=text,
        train_tokens=dataset.train.total,
        val_tokens=len(dataset.val),
        val_bytes=dataset.val_bytes,
        store=dataset.store,
        seconds=time.perf_counter() - started,
        master=master,
    )
