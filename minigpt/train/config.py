"""Every training setting in one typed config (each field a `train` option), and its device recipes."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from minigpt.common.settings import (
    ARCH,
    BUDGET,
    EVAL,
    FEEDBACK,
    FINETUNE,
    MODEL,
    OPT,
    RUN,
    check_choices,
    nested,
    nested_names,
    setting,
)
from minigpt.errors import UsageError
from minigpt.feedback.kinds import PREFERENCES, TASKS
from minigpt.feedback.rewards import EXACT, REWARD_CHOICES
from minigpt.model.config import ARCHS, GPTConfig
from minigpt.model.lora import DEFAULT_TARGETS, TARGET_CHOICES
from minigpt.model.presets import GPT2_VOCAB, PRESETS, model_config
from minigpt.model.presets import preset as get_preset

# Defaults by device. CPU: the recipe bench/bench_train.py and bench/bench_recipe.py find best for a short
# CPU budget, its rates (Muon's, AdamW's with beta1, and the untied head's share, HEAD_LR_FRACTION) tuned on
# it. GPU: nanoGPT's shakespeare_char recipe without dropout, as published, with its beta1 and one rate for
# every weight, and Muon's published rate where a GPU run chooses Muon: the newer options were tuned on the
# CPU only, so the GPU keeps a recipe known to work there.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": dict(
        preset="nano",
        arch="modern",
        optimizer="muon",
        batch_size=16,
        lr=1.6e-2,
        muon_lr=0.012,
        schedule="wsd",
        beta1=0.8,
        # Muon's update is normalised and AdamW's nearly scale-free, so clipping only adds noise: the
        # same steps reached a lower loss without it (bench/bench_recipe.py --steps)
        grad_clip=0.0,
    ),
    "gpu": dict(
        preset="small",
        arch="gpt2",
        optimizer="adamw",
        batch_size=64,
        lr=1e-3,
        muon_lr=0.02,
        schedule="cosine",
        beta1=0.9,
        grad_clip=1.0,
    ),
}
# LoRA's adapters train with AdamW's part, at the rates they were tuned at: the CPU recipe's higher rate
# and lower beta1 suit full fine-tuning but make LoRA's adapters learn far worse (bench/bench_finetune.py),
# so a LoRA run on the CPU keeps its own
LORA_CPU = "LoRA on cpu"
# Learning from feedback wants far smaller steps than either recipe, made for learning from text: at the
# recipe's rates RL loses the few right answers it samples and DPO unlearns the preferences it starts with
# (bench/bench_feedback.py). So preference pairs and tasks train with AdamW at rates of their own on any
# device, keeping the device's beta1, head share and schedule (those they were measured with on the CPU).
# LoRA's adapters start at zero and move through a low-rank product, so they want several times the full
# rate: on either kind they take the rate measured for LoRA on tasks (about ten times the pairs' full
# rate, so one rate serves both) with the beta1 LoRA was tuned at.
LORA_FEEDBACK = "LoRA on pairs or tasks"
RATES: dict[str, dict[str, Any]] = {
    **RECIPES,
    # each measured with clipping at 1, which they keep
    LORA_CPU: dict(lr=8e-3, beta1=0.9, grad_clip=1.0),
    PREFERENCES: dict(optimizer="adamw", lr=1e-4, grad_clip=1.0),
    TASKS: dict(optimizer="adamw", lr=3e-4, grad_clip=1.0),
    LORA_FEEDBACK: dict(optimizer="adamw", lr=1e-3, beta1=0.9, grad_clip=1.0),
}
# head_lr as a fraction of lr when it is not given, by the last of a run's RATES that says
HEAD_LR_FRACTION = {"cpu": 0.25, "gpu": 1.0, LORA_CPU: 1.0, LORA_FEEDBACK: 1.0}
SCHEDULES = ("cosine", "wsd")
# wsd's decay over its cooldown: 1 - sqrt of the cooldown's progress (Hägele et al. 2024, "Scaling Laws and
# Compute-Optimal Training Beyond Fixed Training Durations"), or linear
COOLDOWN_SHAPES = ("sqrt", "linear")
# min_lr as a fraction of lr when it is not given: cosine decays to lr/10 (nanoGPT), wsd to 0
MIN_LR_FRACTION = {"cosine": 0.1, "wsd": 0.0}
DEFAULT_MAX_ITERS = 2000  # the budget of a new run given none
# warmup takes at most this fraction of the steps the budget allows, so a short or slow run still reaches
# the peak lr early and has the rest of the budget to decay
WARMUP_FRACTION = 0.1
OPTIMIZERS = ("adamw", "muon")
ORTHOGONALIZERS = ("newton-schulz", "polar-express")  # Muon's (minigpt.train.muon)
MUON_DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
)  # on the CPU, over few keys (minigpt.model.fused_attention)
BUDGET_SETTINGS = ("max_iters", "max_time", "max_tokens")
_MIN_LR_DEFAULT = ", ".join(f"{s}: {f'lr/{1 / f:g}' if f else '0'}" for s, f in MIN_LR_FRACTION.items())
MAX_DURATION = 10 * 365 * 86400.0  # a time budget past this is a typo, not a plan
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
    if total > MAX_DURATION:
        raise UsageError(
            f"duration {text!r} is past {MAX_DURATION:,.0f} s (ten years): use e.g. 90s, 10m, 1h30m"
        )
    return total


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting; saved in the run's config.json and reused on resume."""

    # the model: a preset's shape and an architecture (None: the device's recipe), then any GPTConfig
    # fields given one by one over both (vocab_size always comes from the tokenizer)
    preset: str | None = setting(None, f"Model shape preset: {', '.join(PRESETS)}.", panel=MODEL, by=RECIPES)
    arch: str | None = setting(
        None, "gpt2 (maps to Hugging Face GPT-2) or modern; the flags below override it.", panel=ARCH,
        choices=tuple(ARCHS), by=RECIPES,
    )  # fmt: skip
    overrides: dict[str, Any] = nested(GPTConfig, skip=("vocab_size",))
    # optimisation
    batch_size: int | None = setting(None, "Sequences per micro-batch (per process).", panel=OPT, by=RECIPES)
    grad_accum: int = setting(1, "Micro-batches accumulated per optimizer step.", panel=OPT)
    batch_ramp: float = setting(
        0.0, "Grow the batch from a quarter of --batch-size to all of it, linearly over this fraction of the "
        "budget (0: the whole batch from the start).", panel=OPT,
    )  # fmt: skip
    seq_ramp: float = setting(
        0.0, "Grow the training windows from a quarter of --block-size to all of it, linearly over this "
        "fraction of the budget (0: whole windows from the start; text only).", panel=OPT,
    )  # fmt: skip
    lr: float | None = setting(
        None, "Peak learning rate (by the device for text and conversations, by the data on any device for "
        "preference pairs and tasks).", panel=OPT, by=RATES,
    )  # fmt: skip
    head_lr: float | None = setting(
        None, "Peak learning rate of an untied LM head (a tied one learns at --lr, as the embedding).",
        panel=OPT, shown=", ".join(f"{k}: {f'lr*{f:g}' if f != 1 else 'lr'}" for k, f in HEAD_LR_FRACTION.items()),
    )  # fmt: skip
    min_lr: float | None = setting(
        None, "Learning rate at the end of the decay.", panel=OPT, shown=_MIN_LR_DEFAULT
    )
    warmup: int = setting(
        100, f"Linear warmup steps, at most {WARMUP_FRACTION:.0%} of what the budget allows.", panel=OPT
    )
    schedule: str | None = setting(
        None, "After warmup: cosine decays to --min-lr over the whole budget; wsd holds the peak lr, then "
        "decays over the last --cooldown of it.", panel=OPT, choices=SCHEDULES, by=RECIPES,
    )  # fmt: skip
    cooldown: float = setting(0.5, "Fraction of the budget wsd spends decaying.", panel=OPT)
    cooldown_shape: str = setting(
        "sqrt", "How wsd decays: sqrt falls fast, then slowly (1 - the square root of the cooldown's "
        "progress), linear evenly.", panel=OPT, choices=COOLDOWN_SHAPES,
    )  # fmt: skip
    weight_decay: float = setting(0.1, "AdamW weight decay on weight matrices.", panel=OPT)
    grad_clip: float | None = setting(None, "Clip the gradient norm to this (0: off).", panel=OPT, by=RATES)
    beta1: float | None = setting(
        None, "AdamW beta1 (its momentum; preference pairs and tasks keep the device's).", panel=OPT, by=RATES
    )
    beta2: float = setting(0.99, "AdamW beta2.", panel=OPT)
    optimizer: str | None = setting(
        None, "adamw, or muon: minigpt's Muon for the blocks' weight matrices, AdamW for the rest.", panel=OPT,
        choices=OPTIMIZERS, by=RATES,
    )  # fmt: skip
    muon_lr: float | None = setting(
        None, "Muon's peak learning rate (--optimizer muon).", panel=OPT, by=RECIPES
    )
    orthogonalizer: str = setting(
        "newton-schulz", "How Muon orthogonalises its update: newton-schulz (one quintic, 5 times) or "
        "polar-express (5 quintics, each optimal for where the last left the singular values).", panel=OPT,
        choices=ORTHOGONALIZERS,
    )  # fmt: skip
    normuon: bool = setting(
        False, "NorMuon: Muon's update row by row over the root of its running mean square.", panel=OPT
    )
    muon_dtype: str = setting(
        "auto", "The dtype of Muon's iterations: auto is bfloat16 on GPUs; on the CPU the faster of float32 and "
        "bfloat16 for this run's shapes, timed once on this machine (bfloat16 only where the CPU may have bf16 "
        "instructions).", panel=OPT, choices=MUON_DTYPES,
    )  # fmt: skip
    zero_init: bool = setting(
        False, "Start every block's output projections (and an untied head) at zero.", panel=OPT
    )
    # fine-tuning from a run (init_from): LoRA adapters on the frozen base instead of every weight
    lora_rank: int | None = setting(
        None, "Train LoRA adapters of this rank on the frozen --init-from run instead of every weight "
        "(saved on their own, tied to that run's weights).", panel=FINETUNE, shown="none, every weight trains",
    )  # fmt: skip
    lora_alpha: float | None = setting(
        None, "LoRA's scale: updates are multiplied by alpha / rank.", panel=FINETUNE, shown="2 x lora-rank"
    )
    lora_targets: str = setting(
        DEFAULT_TARGETS, f"Layers of every block to adapt, and the embedding, head, norms or biases to train "
        f"whole, comma-separated: {TARGET_CHOICES}.", panel=FINETUNE,
    )  # fmt: skip
    # learning from feedback (with init_from): DPO on preference pairs, RL with a reward on tasks
    dpo_beta: float = setting(
        0.1, "DPO's beta (preference pairs): how far a preference may move the model from where it started "
        "(higher: less far).", panel=FEEDBACK,
    )  # fmt: skip
    reward: str | None = setting(
        None, f"How RL scores the sampled answers to tasks: {REWARD_CHOICES} (your Python, run in this "
        "process). Given, the files are read as tasks.", panel=FEEDBACK, shown=EXACT,
    )  # fmt: skip
    group_size: int = setting(
        8, "Answers RL samples to each task, each weighed against its group's mean reward.", panel=FEEDBACK
    )
    answer_tokens: int = setting(32, "The longest answer RL samples, in tokens.", panel=FEEDBACK)
    temperature: float = setting(1.0, "The temperature RL samples answers at.", panel=FEEDBACK)
    kl_coef: float = setting(
        0.04, "Weight of RL's KL term to the starting model (k3 estimator; 0: none).", panel=FEEDBACK
    )
    reward_timeout: float = setting(
        10.0, "Seconds a module:function reward may take on one answer.", panel=FEEDBACK
    )
    # budget: the first one reached stops the run
    max_iters: int | None = setting(
        None, "Stop at this optimizer step (counted over the whole run).", panel=BUDGET,
        shown=f"{DEFAULT_MAX_ITERS} when no budget is given",
    )  # fmt: skip
    max_time: float | None = setting(  # seconds
        None, "Finish within this much wall time, e.g. 90s, 10m, 1h30m (a bare number is seconds): the whole "
        "command, start-up and the final evaluation included.", panel=BUDGET, parse=parse_duration,
        metavar="<duration>",
    )  # fmt: skip
    max_tokens: int | None = setting(
        None, "Stop after this many training tokens (over the whole run).", panel=BUDGET
    )
    # evaluation and logging
    eval_every: int = setting(
        500,
        "Evaluate (and checkpoint) every N steps, bar one within N/2 steps of the final evaluation.",
        panel=EVAL,
    )
    eval_iters: int = setting(
        50, "Batches of fixed windows per split (validation and train) per evaluation.", panel=EVAL
    )
    eval_chunk: int | None = setting(
        None, "Windows an evaluation runs in one forward pass (the same windows are evaluated either way), up "
        "to 256 and 32M logits. Default: the batch size on the CPU (larger passes outgrow its caches), the "
        "most on a GPU.", panel=EVAL, shown="the batch size on the CPU", min=1,
    )  # fmt: skip
    log_every: int = setting(10, "Log the step loss every N steps.", panel=EVAL)
    # runtime
    seed: int = setting(1337, "Random seed (weights, batches, dropout).", panel=RUN)
    device: str = setting("auto", "auto, cpu, cuda or mps.", panel=RUN)
    dtype: str = setting(
        "auto", "auto, float32, bfloat16 or float16 (autocast). auto: bfloat16 on GPUs that have it (else "
        "float16); on the CPU the faster of float32 and bfloat16 autocast for this run's shapes, timed once on "
        "this machine and kept in its tuning cache (bfloat16 only where the CPU may have bf16 instructions).",
        panel=RUN,
    )  # fmt: skip
    attention_dtype: str = setting(
        "auto", "The dtype of attention over at most 256 keys on the CPU under bfloat16 autocast: float32 runs "
        "torch's fused kernel on float32 copies, bfloat16 runs it as bf16 batched products (its weights kept "
        "for the backward pass). auto: the faster for this run's shapes, timed once on this machine with "
        "--dtype. GPUs and longer blocks use torch's kernel in the autocast dtype.", panel=RUN,
        choices=ATTENTION_DTYPES,
    )  # fmt: skip
    threads: int | None = setting(
        None, "CPU threads (also fixed by OMP_NUM_THREADS). Default: timed on the run's own steps, and "
        "timed again as it goes, so that cores other work takes are given up.", panel=RUN,
        shown="measured", min=1,
    )  # fmt: skip
    compile: bool = setting(False, "torch.compile the model.", panel=RUN)

    def __post_init__(self) -> None:
        _check_field_types(self)
        check_choices(self)
        self._check_counts()
        self._check_rates()
        self._check_model()

    def _check_counts(self) -> None:
        for name in ("batch_size", "grad_accum", "eval_every", "eval_iters", "log_every"):
            value = getattr(self, name)
            if value is None and name == "batch_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_iters", "max_tokens", "threads", "eval_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if self.max_time is not None and not 0 < self.max_time <= MAX_DURATION:
            raise UsageError(
                f"max_time must be a positive number of seconds up to {MAX_DURATION:,.0f} (ten years), "
                f"got {self.max_time}"
            )

    def _check_rates(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"lr must be positive, got {self.lr}")
        if self.muon_lr is not None and not self.muon_lr > 0:
            raise UsageError(f"muon_lr must be positive, got {self.muon_lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else math.inf):
            raise UsageError(f"need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup < 0 or self.weight_decay < 0 or (self.grad_clip or 0) < 0:
            raise UsageError("warmup, weight_decay and grad_clip must not be negative (0 turns them off)")
        if self.head_lr is not None and not self.head_lr > 0:
            raise UsageError(f"head_lr must be positive, got {self.head_lr}")
        if self.beta1 is not None and not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise UsageError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        for name in ("batch_ramp", "seq_ramp"):
            if not 0 <= getattr(self, name) <= 1:
                raise UsageError(f"{name} is a fraction of the budget in [0, 1], got {getattr(self, name)}")
        if not 0 < self.cooldown <= 1:
            raise UsageError(f"cooldown is a fraction of the budget in (0, 1], got {self.cooldown}")
        if self.lora_rank is not None and not 1 <= self.lora_rank <= 4096:
            raise UsageError(f"lora_rank must be from 1 to 4096, got {self.lora_rank}")
        if self.lora_alpha is not None and not 0 < self.lora_alpha < 1e6:
            raise UsageError(f"lora_alpha must be a positive number, got {self.lora_alpha}")
        self._check_feedback()

    def _check_feedback(self) -> None:
        if not self.dpo_beta > 0 or not self.temperature > 0 or not self.reward_timeout > 0:
            raise UsageError("dpo_beta, temperature and reward_timeout must be positive")
        if self.group_size < 2 or self.answer_tokens < 1 or self.kl_coef < 0:
            raise UsageError(
                "group_size must be at least 2 (answers are weighed against each other), answer_tokens at "
                "least 1 and kl_coef not negative"
            )

    def _check_model(self) -> None:
        """The model's settings are GPTConfig's own fields of their types; once the preset is known (given,
        or filled by the recipe), building the GPTConfig checks them together."""
        if not isinstance(self.overrides, dict):
            raise UsageError(f"the model settings are not a JSON object, got {self.overrides!r}")
        object.__setattr__(self, "overrides", {k: v for k, v in self.overrides.items() if v is not None})
        unknown = sorted(set(self.overrides) - set(nested_names(TrainConfig, "overrides")))
        if unknown:
            raise UsageError(f"not settings of the model: {', '.join(map(str, unknown))}")
        kinds = {f.name: str(f.type) for f in fields(GPTConfig)}
        for name, value in self.overrides.items():
            _check_type(name, kinds[name], value)
        if self.preset is not None:
            get_preset(self.preset)
            self.model_config(GPT2_VOCAB)

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
        # runs saved before schedules, architectures and optimizers were settings: cosine, GPT-2, AdamW;
        # before the head had its own rate, it learned at lr; before wsd's decay had a shape, it was linear
        data = {
            "schedule": "cosine", "arch": "gpt2", "optimizer": "adamw", "head_lr": data.get("lr"),
            "cooldown_shape": "linear", **data,
        }  # fmt: skip
        # runs saved before the model's settings were overrides held them flat (tie for tie_embeddings)
        flat = {"tie_embeddings" if k == "tie" else k: v for k, v in data.items() if k not in known}
        model = {k: v for k, v in flat.items() if k in nested_names(cls, "overrides")}
        overrides = data.get("overrides", {})
        if isinstance(overrides, dict):
            overrides = {**model, **overrides}
        return cls(**{k: v for k, v in data.items() if k in known and k != "overrides"}, overrides=overrides)

    def with_recipe(self, device_type: str, data: str | None = None) -> TrainConfig:
        """Fill the settings left unset with the recipe measured best for this kind of device, at the rates
        for the `data` it trains on (a kind of records, minigpt.feedback.kinds; None: text)."""
        device = "cpu" if device_type == "cpu" else "gpu"
        kinds = rate_kinds(device, self.lora_rank is not None, data)
        recipe = {k: v for kind in kinds for k, v in RATES[kind].items()}
        filled = {k: v for k, v in recipe.items() if getattr(self, k) is None}
        lr = self.lr if self.lr is not None else recipe["lr"]
        schedule = self.schedule or recipe["schedule"]
        if self.min_lr is None:
            filled["min_lr"] = lr * MIN_LR_FRACTION[schedule]
        if self.head_lr is None:
            share = next(HEAD_LR_FRACTION[k] for k in reversed(kinds) if k in HEAD_LR_FRACTION)
            filled["head_lr"] = lr * share
        return replace(self, **filled)

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model: the preset, the architecture (GPT-2's when none) and the overrides."""
        if self.preset is None:
            raise AssertionError("model_config needs a resolved config (with_recipe)")
        return model_config(self.preset, self.arch, **self.overrides, vocab_size=vocab_size)


def rate_kinds(device: str, lora: bool, data: str | None) -> tuple[str, ...]:
    """The RATES a run takes, each over the one before: its device's recipe, then what LoRA or learning
    from preference pairs or tasks changes of it."""
    if data in (PREFERENCES, TASKS):
        return (device, LORA_FEEDBACK if lora else data)
    return (device, LORA_CPU) if lora and device == "cpu" else (device,)


_KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a finite number", "str": "text"}


@dataclass(frozen=True)
class LaunchConfig:
    """Where a run is written, what it starts from, and how many processes on this machine train it."""

    out: Path | None = setting(
        None, "Run directory to write.", panel=RUN, shown="checkpoints/<first file's name>"
    )
    resume: Path | None = setting(
        None, "Continue this run with its saved settings. Budget options given with it replace the saved "
        "budget as a whole (--max-time then counts this command's time). FILE... given with it say where "
        "the run's text is now, if it moved.", panel=RUN,
    )  # fmt: skip
    allow_data_change: bool = setting(
        False, "With --resume: go on even if the text differs from what the run trained on.", panel=RUN,
        flags=("--allow-data-change",),
    )  # fmt: skip
    init_from: Path | None = setting(
        None, "Fine-tune this run: start from its weights and tokenizer, with a fresh optimizer. On "
        "conversation JSONL the loss counts the assistant's tokens only.", panel=RUN,
    )  # fmt: skip
    overwrite: bool = setting(
        False, "Replace an existing run directory at --out.", panel=RUN, flags=("--overwrite",)
    )
    nproc: int | None = setting(
        None, "Run in N processes on this machine (one per GPU) through torch.distributed.run.", panel=RUN
    )

    # what a resume may be given besides a budget: the rest is the saved run's
    WITH_RESUME = ("resume", "allow_data_change", "overwrite", "nproc")
    # the options only `train` has (`prepare` takes --nproc alone)
    RUN_ONLY = ("out", "resume", "allow_data_change", "init_from", "overwrite")

    def __post_init__(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")

    @property
    def processes(self) -> int:
        return self.nproc or 1


def _check_field_types(config: Any) -> None:
    """Every field holds its declared type (read from config.json, a field may hold anything), and seeds
    fit the 64-bit integers torch takes."""
    for f in fields(config):
        if f.name != "overrides":  # checked field by field against GPTConfig's types
            _check_type(f.name, str(f.type), getattr(config, f.name))
    if not 0 <= config.seed < 2**63:
        raise UsageError(f"seed must be in 0..2**63-1, got {config.seed}")


def _check_type(name: str, kind: str, value: Any) -> None:
    """`value` is of the declared type `kind` (a field's annotation), numbers finite (a NaN compares false
    with every bound, so range checks alone let it through) and counts within torch's 64-bit integers."""
    if value is None and "None" in kind:
        return
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
        raise UsageError(f"{name} must be {wanted}, got {value!r}")


def format_seconds(seconds: float) -> str:
    """A duration with its units spelled out: '45 s', '2 min 30 s', '1 h 5 min'."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    parts = [(hours, "h"), (minutes, "min"), (secs, "s")]
    return " ".join(f"{value} {unit}" for value, unit in parts if value)
