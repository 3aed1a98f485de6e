"""The models a server holds: each run's engine, batcher, and the attention and run views of the page."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.errors import MinigptError
from minigpt.generate.config import EngineConfig
from minigpt.generate.decode import Engine
from minigpt.runs.folder import RunDir
from minigpt.serve.batcher import Batcher
from minigpt.serve.config import ServeConfig
from minigpt.serve.protocol import encode_checked
from minigpt.tokenizer.base import Tokenizer

if TYPE_CHECKING:
    from minigpt.model.gpt import GPT

__all__ = ["ADMIT_WAIT", "ServedModel", "load_models"]

# how long a new request waits for others to arrive, so that requests sent together are prefilled and
# decoded as one batch (bench/bench_serve.py)
ADMIT_WAIT = 0.005


@dataclass
class ServedModel:
    """One run behind the API, named by its folder: the engine that decodes it and its batcher."""

    id: str
    run: RunDir
    engine: Engine
    tokenizer: Tokenizer
    batcher: Batcher
    _gpt: GPT | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _attention_model(self) -> GPT:
        """The torch model the attention view reads: the engine's own, or loaded on first use, so a server on
        the NumPy engine imports torch only when someone asks for attention."""
        with self._lock:
            if self._gpt is None:
                model = getattr(self.engine, "model", None)
                self._gpt = model if model is not None else self.run.load_model("cpu")[0]
            return self._gpt

    def attention(self, text: str, position: int) -> dict[str, Any]:
        """What `minigpt attention TEXT --position P --json` prints: every layer's and head's weights from
        that position over the ones before it, and the ids and tokens of the last block_size tokens of the
        text (all of them, where the command stops at the position: the page draws the whole text)."""
        from minigpt.analysis.attention import attention_row, resolve_index

        block_size = self.engine.block_size
        ids = encode_checked(self.tokenizer, text, block_size, "text")
        dropped = max(0, len(ids) - block_size)
        ids = ids[dropped:]
        pos = resolve_index(position, len(ids), "position", "tokens")
        row = attention_row(self._attention_model(), ids, pos)  # (L, H, pos + 1)
        return {
            "model": self.id,
            "ids": ids,
            "tokens": [
                self.tokenizer.decode_bytes([i]).decode("utf-8", errors="backslashreplace") for i in ids
            ],
            "dropped": dropped,
            "position": pos,
            "n_layer": row.shape[0],
            "n_head": row.shape[1],
            "weights": [[[round(w, 5) for w in r] for r in hs] for hs in row.tolist()],
        }

    def run_info(self) -> dict[str, Any]:
        """The run's summary, its metrics.jsonl records and its parameter breakdown, for the page."""
        from minigpt.model.params import count_params
        from minigpt.runs.summary import summarize

        return {
            "id": self.id,
            "summary": summarize(self.run).to_dict(),
            "metrics": self.run.read_metrics(),
            "params": count_params(self.run.model_config()).to_dict(),
        }


def load_models(
    paths: Sequence[Path], run_on: EngineConfig, cfg: ServeConfig, *, admit_wait: float = ADMIT_WAIT
) -> list[ServedModel]:
    """Each run's engine (choose_backend's pick, as for `minigpt generate`) and batcher, taking `cfg`'s rows
    and queue; ids: folder names."""
    backend, device, dtype = run_on.backend, run_on.device, run_on.dtype
    from minigpt.generate.load import choose_backend, load_engine

    served: list[ServedModel] = []
    for path in paths:
        run = RunDir(path)
        run.read_config()  # a missing or foreign folder is named before any weights are read
        name = run.path.resolve().name
        if any(m.id == name for m in served):
            raise MinigptError(f"two runs are named {name!r}: model ids are folder names, so rename one")
        engine, tokenizer = load_engine(
            run.path,
            choose_backend(backend, device, dtype, weights=run.weights_path),
            device,
            dtype,
            kv_cache=run_on.kv_cache,
        )
        batcher = Batcher(
            engine, tokenizer, max_rows=cfg.max_batch, max_waiting=cfg.queue, admit_wait=admit_wait
        )
        served.append(ServedModel(name, run, engine, tokenizer, batcher))
    return served
