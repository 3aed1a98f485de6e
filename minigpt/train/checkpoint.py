"""What a training checkpoint carries for an exact resume, saved and loaded through RunDir."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from minigpt.common.strict_json import JsonError, parse_json
from minigpt.data.dataset import BatchSampler
from minigpt.errors import MinigptError
from minigpt.model.build import build_model, model_tensors
from minigpt.model.gpt import GPT
from minigpt.model.lora import check_adapter_shapes
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.base import Tokenizer
from minigpt.train.optimizers import Optimizers


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
    # the run's elapsed seconds when its time budget started counting: a time budget given on a resume
    # counts that command's own time
    time_budget_from: float = 0.0
    # the steps the learning rate ramped up over (warmup, capped by the budget: Budget.warmup_steps); -1
    # until the ramp has ended
    warmup_steps: int = -1

    def record_eval(self, losses: dict[str, float]) -> bool:
        """Keep an evaluation's losses; whether its validation loss is the best so far."""
        self.last_eval = dict(losses)
        improved = losses["val_loss"] < self.best_val_loss
        if improved:
            self.best_val_loss, self.best_step = losses["val_loss"], self.step
        return improved


@dataclass
class Trainables:
    """What a step changes and a checkpoint must capture: weights, optimizer moments, batch position, and
    what the objective keeps of the starting model (`reference`: restored in place)."""

    model: GPT
    optimizer: Optimizers
    sampler: BatchSampler
    reference: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_tensors(self.model).items()}
        for name, p in self.model.named_parameters():
            for key, value in self.optimizer.state_items(p):
                out[f"optim/{name}/{key}"] = value
        for key, value in self.sampler.state_dict().items():
            out[f"sampler/{key}"] = value
        for key, value in self.reference.items():
            out[f"reference/{key}"] = value
        out["rng/torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["rng/cuda"] = torch.cuda.get_rng_state()
        return out

    def check(self, tensors: dict[str, torch.Tensor], source: Any) -> None:
        """Refuse a state file whose optimizer moments, sampler or RNG state do not fit this model and
        optimizer, before any of it is loaded: the fused AdamW kernel would run past a short moment and
        crash the process rather than raise."""
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, _, slot = key.removeprefix("optim/").rpartition("/")
                param = params.get(name)
                slots = self.optimizer.slots(param) if param is not None else {}
                _check_moment(key, value, param, slot, slots, source)
            elif not key.startswith(("model/", "sampler/", "rng/", "reference/")):
                raise MinigptError(f"{source}: unexpected tensor {key!r}; is this a minigpt training state?")
        self._check_reference(tensors, source)
        rng = tensors.get("rng/torch")
        like = torch.get_rng_state()
        if rng is None or rng.dtype != like.dtype or rng.shape != like.shape:
            raise MinigptError(f"{source}: the saved random number generator state is missing or damaged")

    def _check_reference(self, tensors: dict[str, torch.Tensor], source: Any) -> None:
        """The saved reference must be exactly the tensors this run's objective keeps."""
        saved = {k.removeprefix("reference/"): v for k, v in tensors.items() if k.startswith("reference/")}
        wrong = sorted(set(saved) ^ set(self.reference)) or sorted(
            k
            for k, v in saved.items()
            if v.shape != self.reference[k].shape or v.dtype != self.reference[k].dtype
        )
        if wrong:
            raise MinigptError(
                f"{source}: the starting model's tensor {wrong[0]!r} the run keeps is missing, unexpected or "
                f"misshapen; the file is damaged or from another run"
            )

    def restore(self, tensors: dict[str, torch.Tensor], source: Any) -> None:
        """Put back everything tensors() captured (`source` names the file in errors)."""
        self.check(tensors, source)
        weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        self._restore_weights(weights, source)
        for name, p in self.model.named_parameters():
            prefix = f"optim/{name}/"
            saved = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if saved:
                # the step count too: the fused AdamW kernel reads it on the parameter's device
                self.optimizer.load_state(p, {k: v.to(p.device) for k, v in saved.items()})
        self.sampler.load_state_dict(
            {k.removeprefix("sampler/"): v for k, v in tensors.items() if k.startswith("sampler/")}
        )
        with torch.no_grad():
            for key, value in self.reference.items():
                value.copy_(tensors[f"reference/{key}"])
        torch.set_rng_state(tensors["rng/torch"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])

    def _restore_weights(self, weights: dict[str, torch.Tensor], source: Any) -> None:
        """The saved weights, checked against the model (a LoRA run's: only its adapter)."""
        lora = self.model.lora
        if lora is None:
            restored = dict(build_model(self.model.config, weights, source, "cpu").named_parameters())
        else:
            check_adapter_shapes(
                self.model.config, lora, {k: tuple(v.shape) for k, v in weights.items()}, source
            )
            restored = weights
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in restored:
                    p.copy_(restored[name])


def _check_moment(
    key: str, value: torch.Tensor, param: torch.Tensor | None, slot: str, slots: dict[str, Any], source: Any
) -> None:
    if param is None:
        raise MinigptError(f"{source}: optimizer state {key!r} belongs to no parameter of this model")
    if slot not in slots:
        # e.g. an AdamW moment for a matrix Muon trains: the state is from another optimizer's run
        raise MinigptError(
            f"{source}: optimizer state {key!r} is not one its parameter's optimizer keeps "
            f"({', '.join(slots)}); the file is damaged or from another run"
        )
    shape = slots[slot]
    if shape is None:  # a step count
        ok = (
            value.numel() == 1
            and value.is_floating_point()
            and bool(torch.isfinite(value).all() and value >= 0)
        )
    else:
        ok = tuple(value.shape) == shape and value.dtype == param.dtype
    if not ok:
        raise MinigptError(
            f"{source}: optimizer state {key!r} has shape {list(value.shape)} ({value.dtype}), which does not "
            f"fit its parameter of shape {list(param.shape)}; the file is damaged: restore it or start a new run"
        )


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
        state = TrainState(**parse_json(meta["state"], nan=True))
    except (KeyError, TypeError, JsonError) as e:
        raise MinigptError(f"{rundir.state_path} has an unreadable training state ({e})") from None
    counts = (state.step, state.tokens, state.best_step + 1, state.world_size - 1, state.warmup_steps + 1)
    numbers = (state.elapsed, state.best_val_loss, state.time_budget_from)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or not all(
        isinstance(x, int | float) and x >= 0 for x in numbers
    ):
        raise MinigptError(f"{rundir.state_path} has an impossible training state (step, tokens or times)")
    return state
