"""Every training setting in one typed config, its device recipes, and how its defaults read in help."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

from minigpt.config import MLPS, NORMS, POSITIONS, GPTConfig
from minigpt.errors import UsageError
from minigpt.presets import preset as get_preset

# Defaults by device. CPU: searched on tinyshakespeare (char) under a 70 s budget on 2 cores
# (bench/bench_train.py); at that budget a 2-layer model's extra steps beat more depth, small batches
# beat large ones, and holding the peak lr for half the run then decaying linearly to 0 (wsd) beat
# cosine to lr/10 by 0.01 in loss; then the modern architecture and Muon each lowered the loss at equal
# wall time (bench/bench_recipe.py). GPU: nanoGPT's shakespeare_char recipe without dropout, as published
# (no GPU here to measure the newer options on).
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": dict(preset="nano", arch="modern", optimizer="muon", batch_size=16, lr=8e-3, schedule="wsd"),
    "gpu": dict(preset="small", arch="gpt2", optimizer="adamw", batch_size=64, lr=1e-3, schedule="cosine"),
}
# Architectures: GPT-2's (the one that maps to Hugging Face GPT-2) and the later choices small-model
# recipes converged on; each train flag overrides the one it names.
ARCHS: dict[str, dict[str, Any]] = {
    "gpt2": dict(pos="learned", norm="layernorm", mlp="gelu", qk_norm=False, tie=True, bias=True),
    # picked by bench/bench_recipe.py on tinyshakespeare (char, 2 CPU cores): rotary, RMSNorm, SwiGLU and an
    # untied head each lowered the loss at equal steps; QK-norm did not, ReLU² and dropping biases raised it
    "modern": dict(pos="rope", norm="rmsnorm", mlp="swiglu", qk_norm=False, tie=False, bias=True),
}
ARCH_SETTINGS = ("pos", "norm", "mlp", "qk_norm", "tie", "bias")
SCHEDULES = ("cosine", "wsd")
# min_lr as a fraction of lr when it is not given: cosine decays to lr/10 (nanoGPT), wsd to 0
MIN_LR_FRACTION = {"cosine": 0.1, "wsd": 0.0}
DEFAULT_MAX_ITERS = 2000  # the budget of a new run given none
# warmup takes at most this fraction of the steps the budget allows, so a short or slow run still reaches
# the peak lr early and has the rest of the budget to decay
WARMUP_FRACTION = 0.1
SHAPE_SETTINGS = ("n_layer", "n_head", "n_embd", "block_size")
OPTIMIZERS = ("adamw", "muon")
BUDGET_SETTINGS = ("max_iters", "max_time", "max_tokens")


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting; saved in the run's config.json and reused on resume."""

    # model shape: a preset, then any explicit overrides (vocab_size always comes from the tokenizer)
    preset: str | None = None  # None: the device's recipe (RECIPES)
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    dropout: float = 0.0
    # architecture: `arch` (None: the device's recipe), then any of its settings overridden
    arch: str | None = None
    pos: str | None = None
    rope_base: float = 10000.0
    norm: str | None = None
    mlp: str | None = None
    qk_norm: bool | None = None
    tie: bool | None = None
    bias: bool | None = None
    n_kv_head: int | None = None
    window: int | None = None
    window_pattern: str = "S"
    # optimisation
    batch_size: int | None = None
    grad_accum: int = 1
    lr: float | None = None
    min_lr: float | None = None  # None: MIN_LR_FRACTION of lr
    warmup: int = 100  # steps, at most WARMUP_FRACTION of those the budget allows
    # after warmup, "cosine" decays from lr to min_lr over the whole budget; "wsd" (warmup-stable-decay)
    # holds lr, then decays linearly to min_lr over the last `cooldown` fraction of the budget
    schedule: str | None = None
    cooldown: float = 0.5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    # "muon": torch's Muon for the blocks' weight matrices at muon_lr (scaled by the schedule), AdamW for the rest
    optimizer: str | None = None  # None: the device's recipe
    muon_lr: float = 0.02
    # fine-tuning from a run (init_from): LoRA adapters of this rank on the frozen base instead of every weight
    lora_rank: int | None = None
    lora_alpha: float | None = None  # None: 2 x lora_rank (the update is scaled by alpha / rank)
    lora_targets: str = "all"  # comma-separated layers of every block (minigpt.lora.TARGET_CHOICES)
    # budget: the first one reached stops the run
    max_iters: int | None = None
    max_time: float | None = None  # seconds
    max_tokens: int | None = None
    # evaluation and logging
    # 50 batches: on tinyshakespeare (char, batch 16) 20 x 16 evenly spaced windows read 0.015 above
    # the whole validation split's loss, 50 x 16 within 0.001; at 256 windows a pass, it costs about
    # what 20 x 16 did
    eval_every: int = 500
    eval_iters: int = 50
    log_every: int = 10
    # runtime
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)
        self._check_counts()
        self._check_rates()
        if self.preset is not None:
            get_preset(self.preset)
        for name, choices in (("arch", tuple(ARCHS)), ("pos", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise UsageError(f"unknown {name} {value!r}: choose {' or '.join(choices)}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.schedule!r}: choose {' or '.join(SCHEDULES)}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}: choose {' or '.join(OPTIMIZERS)}")

    def _check_counts(self) -> None:
        for name in ("batch_size", "grad_accum", "eval_every", "eval_iters", "log_every"):
            value = getattr(self, name)
            if value is None and name == "batch_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_iters", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if self.max_time is not None and not self.max_time > 0:
            raise UsageError(f"max_time must be a positive number of seconds, got {self.max_time}")

    def _check_rates(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"lr must be positive, got {self.lr}")
        if not self.muon_lr > 0:
            raise UsageError(f"muon_lr must be positive, got {self.muon_lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else math.inf):
            raise UsageError(f"need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise UsageError("warmup, weight_decay and grad_clip must not be negative (0 turns them off)")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise UsageError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.cooldown <= 1:
            raise UsageError(f"cooldown is a fraction of the budget in (0, 1], got {self.cooldown}")
        if self.lora_rank is not None and not 1 <= self.lora_rank <= 4096:
            raise UsageError(f"lora_rank must be from 1 to 4096, got {self.lora_rank}")
        if self.lora_alpha is not None and not 0 < self.lora_alpha < 1e6:
            raise UsageError(f"lora_alpha must be a positive number, got {self.lora_alpha}")

    @property
    def has_budget(self) -> bool:
        return any(getattr(self, name) is not None for name in BUDGET_SETTINGS)

    def budget(self) -> dict[str, Any]:
        """The budget settings, unset ones left out."""
        return {name: getattr(self, name) for name in BUDGET_SETTINGS if getattr(self, name) is not None}

    def with_budget(self, budget: dict[str, Any]) -> TrainConfig:
        """This config with `budget` in place of its whole budget (settings left out of it are unset)."""
        unknown = set(budget) - set(BUDGET_SETTINGS)
        if unknown:
            raise UsageError(f"not budget settings: {', '.join(sorted(unknown))}")
        return replace(self, **{**dict.fromkeys(BUDGET_SETTINGS), **budget})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise UsageError("the train settings are not a JSON object")
        known = {f.name for f in fields(cls)}
        # runs saved before schedules, architectures and optimizers were settings: cosine, GPT-2, AdamW
        data = {"schedule": "cosine", "arch": "gpt2", "optimizer": "adamw", **data}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_recipe(self, device_type: str) -> TrainConfig:
        """Fill the settings left unset with the recipe measured best for this kind of device."""
        recipe = RECIPES["cpu" if device_type == "cpu" else "gpu"]
        filled = {k: v for k, v in recipe.items() if getattr(self, k) is None}
        lr = self.lr if self.lr is not None else recipe["lr"]
        schedule = self.schedule or recipe["schedule"]
        if self.min_lr is None:
            filled["min_lr"] = lr * MIN_LR_FRACTION[schedule]
        return replace(self, **filled)

    def model_config(self, vocab_size: int) -> GPTConfig:
        if self.preset is None:
            raise AssertionError("model_config needs a resolved config (with_recipe)")
        shape = get_preset(self.preset)
        shape.pop("vocab_size", None)
        for name in SHAPE_SETTINGS:
            if getattr(self, name) is not None:
                shape[name] = getattr(self, name)
        arch = arch_fields(self.arch or "gpt2", **{k: getattr(self, k) for k in ARCH_SETTINGS})
        return GPTConfig(
            vocab_size=vocab_size,
            dropout=self.dropout,
            rope_base=self.rope_base,
            n_kv_head=self.n_kv_head,
            window=self.window,
            window_pattern=self.window_pattern,
            **arch,
            **shape,
        )


def arch_fields(arch: str | None = None, **flags: Any) -> dict[str, Any]:
    """GPTConfig fields of an architecture (ARCHS; None: GPTConfig's own defaults) with the flags given
    overriding it (None: not given): how `train` builds its model and `params` counts one."""
    if arch is not None and arch not in ARCHS:
        raise UsageError(f"unknown arch {arch!r}: choose {' or '.join(ARCHS)}")
    chosen = {**(ARCHS[arch] if arch else {}), **{k: v for k, v in flags.items() if v is not None}}
    if "tie" in chosen:
        chosen["tie_embeddings"] = chosen.pop("tie")
    return chosen


_KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a finite number", "str": "text"}


def _check_field_types(config: Any) -> None:
    """Every field holds its declared type (read from config.json, a field may hold anything), numbers
    are finite (a NaN compares false with every bound, so range checks alone let it through), and seeds
    and counts fit the 64-bit integers torch takes."""
    for f in fields(config):
        value, kind = getattr(config, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("bool"):
            ok = isinstance(value, bool)
        elif kind.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
        elif kind.startswith("float"):
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            wanted = next(w for k, w in _KIND_WORDS.items() if kind.startswith(k))
            raise UsageError(f"{f.name} must be {wanted}, got {value!r}")
    if not 0 <= config.seed < 2**63:
        raise UsageError(f"seed must be in 0..2**63-1, got {config.seed}")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s|ms)?", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in '90s', '10m', '1h30m' or '1.5h'; a bare number ('90') is seconds."""
    s = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}
    while pos < len(s):
        m = _DURATION.match(s, pos)
        if not m or m.end() == pos:
            break
        total += float(m.group(1)) * scale[m.group(2)]
        pos = m.end()
    if not s or pos != len(s) or total <= 0:
        raise UsageError(
            f"cannot read duration {text!r}: use e.g. 90s, 10m, 1h30m (a bare number is seconds)"
        )
    return total


def format_seconds(seconds: float) -> str:
    """A duration with its units spelled out: '45 s', '2 min 30 s', '1 h 5 min'."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    parts = [(hours, "h"), (minutes, "min"), (secs, "s")]
    return " ".join(f"{value} {unit}" for value, unit in parts if value)


def _number(value: float) -> str:
    """8e-3 rather than 0.008 for small rates, as the help writes them."""
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _arch_value(name: str, value: Any) -> str:
    if name == "tie":
        return "tie" if value else "untie"
    flag = name.replace("_", "-")
    return (flag if value else f"no-{flag}") if isinstance(value, bool) else str(value)


def default_label(name: str) -> str | None:
    """How `train --help` states the default of the setting `name` (None: it has none), read from
    TrainConfig, RECIPES and MIN_LR_FRACTION so the help cannot drift from them."""
    if name in RECIPES["cpu"]:
        return ", ".join(f"{device}: {_number(recipe[name])}" for device, recipe in RECIPES.items())
    if name == "min_lr":
        return ", ".join(f"{s}: {f'lr/{1 / f:g}' if f else '0'}" for s, f in MIN_LR_FRACTION.items())
    if name in SHAPE_SETTINGS:
        return "the preset's"
    if name == "n_kv_head":
        return "n_head"
    if name == "window":
        return "none, every layer full"
    if name in ARCH_SETTINGS:
        return ", ".join(f"{a}: {_arch_value(name, v[name])}" for a, v in ARCHS.items())
    if name == "max_iters":
        return f"{DEFAULT_MAX_ITERS} when no budget is given"
    if name == "lora_alpha":
        return "2 x lora-rank"
    default = next(f.default for f in fields(TrainConfig) if f.name == name)
    if default is None or default is MISSING:
        return None
    if isinstance(default, bool):
        return name if default else f"no-{name}"
    return _number(default)


def option_help(name: str, text: str) -> str:
    """`text` with the default of the setting `name` appended, as `train --help` shows it (the bracket
    escaped: the help is rich markup, where [default: ...] would read as a style and vanish)."""
    label = default_label(name)
    return f"{text} \\[default: {label}]" if label is not None else text
