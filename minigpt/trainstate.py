"""What a training checkpoint carries for an exact resume, saved and loaded through RunDir."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from minigpt.data import BatchSampler
from minigpt.errors import MinigptError
from minigpt.model import GPT
from minigpt.rundir import RunDir
from minigpt.tokenizer import Tokenizer
from minigpt.weights import build_model, model_tensors


@dataclass
class TrainState:
    """Progress that a checkpoint must carry for an exact resume."""

    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # seconds of the run so far, over every command that trained it
    best_val_loss: float = math.inf
    best_step: int = -1
    last_eval: dict[str, float] = field(default_factory=dict)
    # processes that trained the run so far: a resume on another count keeps the global batch
    world_size: int = 1

    def record_eval(self, losses: dict[str, float]) -> bool:
        """Keep an evaluation's losses; whether its validation loss is the best so far."""
        self.last_eval = dict(losses)
        improved = losses["val_loss"] < self.best_val_loss
        if improved:
            self.best_val_loss, self.best_step = losses["val_loss"], self.step
        return improved


@dataclass
class Trainables:
    """What a step changes and a checkpoint must capture: weights, optimizer moments, batch position."""

    model: GPT
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_tensors(self.model).items()}
        for name, p in self.model.named_parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{name}/{key}"] = value
        for key, value in self.sampler.state_dict().items():
            out[f"sampler/{key}"] = value
        out["rng/torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["rng/cuda"] = torch.cuda.get_rng_state()
        return out

    def restore(self, tensors: dict[str, torch.Tensor], source: Any) -> None:
        """Put back everything tensors() captured (`source` names the file in errors)."""
        weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        restored = build_model(self.model.config, weights, source, "cpu")
        with torch.no_grad():
            pairs = zip(self.model.parameters(), restored.parameters(), strict=True)
            for p, q in pairs:
                p.copy_(q)
        for name, p in self.model.named_parameters():
            prefix = f"optim/{name}/"
            saved = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if saved:
                self.optimizer.state[p] = {
                    k: (v.to(p.device) if k != "step" else v) for k, v in saved.items()
                }
        self.sampler.load_state_dict(
            {k.removeprefix("sampler/"): v for k, v in tensors.items() if k.startswith("sampler/")}
        )
        torch.set_rng_state(tensors["rng/torch"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])


def save_checkpoint(
    rundir: RunDir,
    parts: Trainables,
    tokenizer: Tokenizer,
    state: TrainState,
    settings: dict[str, Any],
    save_weights: bool,
) -> None:
    """config.json (`settings`: its train, data and metrics sections), the best weights when `save_weights`,
    then the resumable state; each file atomic, and the weights and state headers name their step."""
    step = {"step": str(state.step)}
    rundir.save(parts.model, tokenizer, settings, save_weights=save_weights, weights_metadata=step)
    meta = {"state": json.dumps(asdict(state)), "train": json.dumps(settings["train"]), **step}
    rundir.save_state(parts.tensors(), meta)


def load_checkpoint(rundir: RunDir, parts: Trainables) -> TrainState:
    """Restore what save_checkpoint wrote into `parts`; any mismatch is a clean error."""
    tensors, meta = rundir.load_state()
    parts.restore(tensors, rundir.state_path)
    try:
        return TrainState(**json.loads(meta["state"]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise MinigptError(f"{rundir.state_path} has an unreadable training state ({e})") from None
