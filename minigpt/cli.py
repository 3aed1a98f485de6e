"""The `minigpt` command line: parse typed options, build configs, call the library."""

from __future__ import annotations

import difflib
import json
import re
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

try:  # typer 0.2x vendors click as typer._click; older typer raises click's own exceptions
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors  # type: ignore[no-redef]

from minigpt import __version__
from minigpt.errors import MinigptError
from minigpt.lora import TARGET_CHOICES
from minigpt.presets import PRESETS
from minigpt.rundir import DEFAULT_ROOT
from minigpt.trainconfig import WARMUP_FRACTION, option_help

SEED_MAX = 2**63 - 1  # torch and NumPy both take seeds in 0..2**63-1


def _closest(word: str, choices: list[str]) -> str | None:
    """The choice `word` most likely meant: one it abbreviates, else the nearest spelling."""
    prefixed = [c for c in choices if c.startswith(word)]
    if prefixed:
        return min(prefixed, key=len)
    near = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return near[0] if near else None


def _usage_line(e: click_errors.UsageError) -> str:
    """A usage error as one line: what was wrong, the option or command meant, where help is."""
    ctx = e.ctx
    where = f"see `{ctx.command_path} --help`" if ctx else "see `minigpt --help`"
    if isinstance(e, click_errors.NoSuchOption) and ctx is not None:
        names = [n for p in ctx.command.params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]
        guess = _closest(e.option_name, names)
        hint = f": did you mean {guess}?" if guess else ""
        return f"unknown option {e.option_name} for `{ctx.command_path}`{hint} ({where})"
    message = " ".join(e.format_message().split())
    if ctx is not None and hasattr(ctx.command, "list_commands") and message.startswith("No such command"):
        given = message.split("'")[1] if "'" in message else ""
        guess = _closest(given, list(ctx.command.list_commands(ctx)))
        return f"unknown command {given!r}{f': did you mean {guess!r}?' if guess else ''} ({where})"
    return f"{message[:1].lower()}{message[1:]} ({where})"


class _Group(TyperGroup):
    """Errors as one line on stderr, never a traceback or a box: a MinigptError with its exit code, a
    usage error (unknown option, bad value, missing argument) with exit code 2 and the closest valid name."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except MinigptError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as e:
            text = e.ctx.get_help() if e.ctx else str(e)  # rich help prints itself and returns ""
            if text:
                typer.echo(text)
            sys.exit(2)
        except click_errors.UsageError as e:
            typer.echo(f"error: {_usage_line(e)}", err=True)
            sys.exit(2)
        except click_errors.ClickException as e:
            typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_Group,
    help="Train, sample and inspect small GPT-style language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minigpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Train, sample and inspect small GPT-style language models.

    minigpt train FILE      train a model on your text (checkpoints under checkpoints/)
    minigpt generate TEXT   continue TEXT with the latest model
    minigpt params          parameter breakdown of a run, a preset or any shape
    """
    # `train --max-time` counts from here: the budget is the wall time of the whole command
    ctx.obj = {"started": time.perf_counter()}


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


_MODEL = "Model shape"
_ARCH = "Architecture"
_DATA = "Data and tokenizer"
_OPT = "Optimisation"
_BUDGET = "Budget (the first reached stops)"
_EVAL = "Evaluation and logging"
_RUN = "Run"
_FINETUNE = "Fine-tuning (with --init-from)"


# the architecture options, shared by `train` (which builds the model) and `params` (which counts it)
BiasOption = Annotated[
    bool | None,
    typer.Option(
        "--bias/--no-bias",
        help=option_help("bias", "Biases in Linear and LayerNorm layers."),
        rich_help_panel=_ARCH,
    ),
]
TieOption = Annotated[
    bool | None,
    typer.Option(
        "--tie/--untie",
        "--tied/--untied",
        help=option_help("tie", "Share the token embedding with the LM head."),
        rich_help_panel=_ARCH,
    ),
]
ArchOption = Annotated[
    str | None,
    typer.Option(
        help=option_help("arch", "gpt2 (maps to Hugging Face GPT-2) or modern; the flags below override it."),
        rich_help_panel=_ARCH,
    ),
]
PosOption = Annotated[
    str | None,
    typer.Option(
        help=option_help("pos", "Positions: learned (wpe) or rope (rotary)."), rich_help_panel=_ARCH
    ),
]
RopeBaseOption = Annotated[
    float | None,
    typer.Option(help=option_help("rope_base", "Base of the rotary frequencies."), rich_help_panel=_ARCH),
]
NormOption = Annotated[
    str | None, typer.Option(help=option_help("norm", "layernorm or rmsnorm."), rich_help_panel=_ARCH)
]
MlpOption = Annotated[
    str | None,
    typer.Option(
        help=option_help("mlp", "MLP activation: gelu, relu2 (ReLU²) or swiglu."), rich_help_panel=_ARCH
    ),
]
QkNormOption = Annotated[
    bool | None,
    typer.Option(
        "--qk-norm/--no-qk-norm",
        help=option_help("qk_norm", "RMSNorm of each head's queries and keys."),
        rich_help_panel=_ARCH,
    ),
]
NKvHeadOption = Annotated[
    int | None,
    typer.Option(
        help=option_help("n_kv_head", "Key/value heads (grouped-query attention; 1 is multi-query)."),
        rich_help_panel=_ARCH,
    ),
]
WindowOption = Annotated[
    int | None,
    typer.Option(help=option_help("window", "Tokens a local (S) layer attends to."), rich_help_panel=_ARCH),
]
WindowPatternOption = Annotated[
    str | None,
    typer.Option(
        help=option_help(
            "window_pattern", "S (local) and L (full) per layer, repeated; the last layer is L."
        ),
        rich_help_panel=_ARCH,
    ),
]


@app.command()
def params(
    run: Annotated[
        Path | None,
        typer.Argument(help="A run directory written by `minigpt train` (omit to count a preset or shape)."),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(help=f"Named shape: {', '.join(PRESETS)}."),
    ] = None,
    n_layer: Annotated[int | None, typer.Option(help="Number of transformer blocks.")] = None,
    n_head: Annotated[int | None, typer.Option(help="Attention heads per block.")] = None,
    n_embd: Annotated[int | None, typer.Option(help="Model width d_model (divisible by n_head).")] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary size (default 50,257, GPT-2's BPE).")
    ] = None,
    block_size: Annotated[int | None, typer.Option(help="Context length in tokens.")] = None,
    bias: BiasOption = None,
    tie: TieOption = None,
    arch: ArchOption = None,
    pos: PosOption = None,
    norm: NormOption = None,
    mlp: MlpOption = None,
    qk_norm: QkNormOption = None,
    n_kv_head: NKvHeadOption = None,
    window: WindowOption = None,
    window_pattern: WindowPatternOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """GPT-3 style parameter breakdown, reconciled with the module, plus memory, FLOPs and KV cache.

    Without arguments: the newest run under checkpoints/. Examples: `minigpt params --preset gpt3-175b`,
    `minigpt params --n-layer 6 --n-head 6 --n-embd 384 --vocab-size 65 --block-size 256`,
    `minigpt params --preset small --arch modern --mlp swiglu --n-kv-head 2 --window 64`,
    `minigpt params checkpoints/demo`.
    """
    from minigpt.params import count_params
    from minigpt.presets import shape_config
    from minigpt.rundir import RunDir
    from minigpt.runs import summarize
    from minigpt.trainconfig import arch_fields
    from minigpt.views import print_json, print_params, training_summary

    shape = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size)
    flags = dict(
        bias=bias, tie=tie, pos=pos, norm=norm, mlp=mlp, qk_norm=qk_norm, n_kv_head=n_kv_head, window=window,
        window_pattern=window_pattern,
    )  # fmt: skip
    shape_given = any(v is not None for v in (preset, arch, *shape.values(), *flags.values()))
    if run is not None and shape_given:
        raise MinigptError("give either a run directory or shape options, not both", exit_code=2)
    if shape_given:
        report = count_params(shape_config(preset, **shape, **arch_fields(arch, **flags)))
        if as_json:
            print_json({**report.to_dict(), "name": preset or "custom shape"})
        else:
            print_params(report, preset or "custom shape")
        return
    summary = summarize(RunDir(run) if run is not None else RunDir.latest())
    report = count_params(RunDir(summary.path).model_config())
    if as_json:
        print_json({**report.to_dict(), "name": summary.path, "stored_total": summary.params,
                    "run": summary.to_dict()})  # fmt: skip
    else:
        print_params(report, summary.path, summary.params, training_summary(summary))


@app.command()
def runs(
    root: Annotated[Path, typer.Argument(help="The folder that holds the run directories.")] = DEFAULT_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the runs under a folder, newest first: data, tokenizer, shape, steps, best loss, age."""
    from minigpt.runs import list_runs
    from minigpt.views import print_json, runs_view

    summaries, problems = list_runs(root)
    for problem in problems:
        typer.echo(f"warning: skipped {problem}", err=True)
    if as_json:
        print_json([s.to_dict() for s in summaries])
        return
    if not summaries:
        typer.echo(f"no runs under {root}/: train one with `minigpt train FILE`", err=True)
        return
    from rich.console import Console

    Console().print(runs_view(summaries, f"Runs under {root}"))


@app.command()
def train(
    ctx: typer.Context,
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Text file(s) or directories of .txt files to train on (omit with --resume).",
            show_default=False,
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help=option_help("preset", f"Model shape preset: {', '.join(PRESETS)}."), rich_help_panel=_MODEL
        ),
    ] = None,
    n_layer: Annotated[
        int | None,
        typer.Option(help=option_help("n_layer", "Transformer blocks."), rich_help_panel=_MODEL),
    ] = None,
    n_head: Annotated[
        int | None,
        typer.Option(help=option_help("n_head", "Attention heads per block."), rich_help_panel=_MODEL),
    ] = None,
    n_embd: Annotated[
        int | None,
        typer.Option(
            help=option_help("n_embd", "Model width (divisible by --n-head)."), rich_help_panel=_MODEL
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(help=option_help("block_size", "Context length in tokens."), rich_help_panel=_MODEL),
    ] = None,
    dropout: Annotated[
        float | None,
        typer.Option(help=option_help("dropout", "Dropout probability in [0, 1)."), rich_help_panel=_MODEL),
    ] = None,
    bias: BiasOption = None,
    arch: ArchOption = None,
    pos: PosOption = None,
    rope_base: RopeBaseOption = None,
    norm: NormOption = None,
    mlp: MlpOption = None,
    qk_norm: QkNormOption = None,
    n_kv_head: NKvHeadOption = None,
    window: WindowOption = None,
    window_pattern: WindowPatternOption = None,
    tie: TieOption = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="char, bpe (trained on your text), gpt2/r50k_base/p50k_base/cl100k_base/o200k_base, or a .tiktoken file. \\[default: bpe]",
            rich_help_panel=_DATA,
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        typer.Option(help="Vocabulary size for --tokenizer bpe. \\[default: 512]", rich_help_panel=_DATA),
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option(
            help="Last fraction of the text held out for validation. \\[default: 0.1]", rich_help_panel=_DATA
        ),
    ] = None,
    val_file: Annotated[
        Path | None,
        typer.Option(help="Validate on this text instead of a held-out fraction.", rich_help_panel=_DATA),
    ] = None,
    encoding: Annotated[
        str | None,
        typer.Option(help="Text encoding of the input files. \\[default: utf-8]", rich_help_panel=_DATA),
    ] = None,
    encoding_errors: Annotated[
        str | None,
        typer.Option(
            help="strict: stop at undecodable bytes; replace: substitute U+FFFD. \\[default: strict]",
            rich_help_panel=_DATA,
        ),
    ] = None,
    skip_bad_records: Annotated[
        bool,
        typer.Option(
            "--skip-bad-records",
            help="Conversation JSONL: skip bad records (counted and the first one named) instead of stopping "
            "at the first.",
            rich_help_panel=_DATA,
        ),
    ] = False,
    batch_size: Annotated[
        int | None,
        typer.Option(
            help=option_help("batch_size", "Sequences per micro-batch (per process)."), rich_help_panel=_OPT
        ),
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option(
            help=option_help("grad_accum", "Micro-batches accumulated per optimizer step."),
            rich_help_panel=_OPT,
        ),
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help=option_help("lr", "Peak learning rate."), rich_help_panel=_OPT)
    ] = None,
    min_lr: Annotated[
        float | None,
        typer.Option(
            help=option_help("min_lr", "Learning rate at the end of the decay."), rich_help_panel=_OPT
        ),
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(
            help=option_help(
                "warmup", f"Linear warmup steps, at most {WARMUP_FRACTION:.0%} of what the budget allows."
            ),
            rich_help_panel=_OPT,
        ),
    ] = None,
    schedule: Annotated[
        ScheduleName | None,
        typer.Option(
            help=option_help(
                "schedule",
                "After warmup: cosine decays to --min-lr over the whole budget; wsd holds the peak lr, then "
                "decays linearly over the last --cooldown of it.",
            ),
            rich_help_panel=_OPT,
        ),
    ] = None,
    cooldown: Annotated[
        float | None,
        typer.Option(
            help=option_help("cooldown", "Fraction of the budget wsd spends decaying."), rich_help_panel=_OPT
        ),
    ] = None,
    weight_decay: Annotated[
        float | None,
        typer.Option(
            help=option_help("weight_decay", "AdamW weight decay on weight matrices."), rich_help_panel=_OPT
        ),
    ] = None,
    grad_clip: Annotated[
        float | None,
        typer.Option(
            help=option_help("grad_clip", "Clip the gradient norm to this (0: off)."), rich_help_panel=_OPT
        ),
    ] = None,
    beta2: Annotated[
        float | None, typer.Option(help=option_help("beta2", "AdamW beta2."), rich_help_panel=_OPT)
    ] = None,
    optimizer: Annotated[
        OptimizerName | None,
        typer.Option(
            help=option_help(
                "optimizer",
                "adamw, or muon: torch's Muon for the blocks' weight matrices, AdamW for the rest.",
            ),
            rich_help_panel=_OPT,
        ),
    ] = None,
    muon_lr: Annotated[
        float | None,
        typer.Option(
            help=option_help("muon_lr", "Muon's peak learning rate (--optimizer muon)."), rich_help_panel=_OPT
        ),
    ] = None,
    lora_rank: Annotated[
        int | None,
        typer.Option(
            help="Train LoRA adapters of this rank on the frozen --init-from run instead of every weight "
            "(saved on their own, tied to that run's weights).",
            rich_help_panel=_FINETUNE,
        ),
    ] = None,
    lora_alpha: Annotated[
        float | None,
        typer.Option(
            help=option_help("lora_alpha", "LoRA's scale: updates are multiplied by alpha / rank."),
            rich_help_panel=_FINETUNE,
        ),
    ] = None,
    lora_targets: Annotated[
        str | None,
        typer.Option(
            help=option_help(
                "lora_targets", f"Layers of every block to adapt, comma-separated: {TARGET_CHOICES}."
            ),
            rich_help_panel=_FINETUNE,
        ),
    ] = None,
    max_iters: Annotated[
        int | None,
        typer.Option(
            help=option_help("max_iters", "Stop at this optimizer step (counted over the whole run)."),
            rich_help_panel=_BUDGET,
        ),
    ] = None,
    max_time: Annotated[
        str | None,
        typer.Option(
            help="Finish within this much wall time, e.g. 90s, 10m, 1h30m (a bare number is seconds): the whole "
            "command, start-up and the final evaluation included.",
            rich_help_panel=_BUDGET,
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            help="Stop after this many training tokens (over the whole run).", rich_help_panel=_BUDGET
        ),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option(
            help=option_help("eval_every", "Evaluate (and checkpoint) every N steps."), rich_help_panel=_EVAL
        ),
    ] = None,
    eval_iters: Annotated[
        int | None,
        typer.Option(
            help=option_help(
                "eval_iters", "Batches of fixed windows per split (validation and train) per evaluation."
            ),
            rich_help_panel=_EVAL,
        ),
    ] = None,
    log_every: Annotated[
        int | None,
        typer.Option(
            help=option_help("log_every", "Log the step loss every N steps."), rich_help_panel=_EVAL
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help=option_help("seed", "Random seed (weights, batches, dropout)."), rich_help_panel=_RUN
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help=option_help("device", "auto, cpu, cuda or mps."), rich_help_panel=_RUN),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help=option_help("dtype", "auto, float32, bfloat16 or float16 (autocast)."), rich_help_panel=_RUN
        ),
    ] = None,
    compile: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help=option_help("compile", "torch.compile the model."),
            rich_help_panel=_RUN,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory to write. \\[default: checkpoints/<first file's name>]", rich_help_panel=_RUN
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue this run with its saved settings. Budget options given with it replace the saved "
            "budget as a whole (--max-time then counts this command's time). FILE... given with it say where "
            "the run's text is now, if it moved.",
            rich_help_panel=_RUN,
        ),
    ] = None,
    allow_data_change: Annotated[
        bool,
        typer.Option(
            "--allow-data-change",
            help="With --resume: go on even if the text differs from what the run trained on.",
            rich_help_panel=_RUN,
        ),
    ] = False,
    init_from: Annotated[
        Path | None,
        typer.Option(
            help="Fine-tune this run: start from its weights and tokenizer, with a fresh optimizer. On "
            "conversation JSONL the loss counts the assistant's tokens only.",
            rich_help_panel=_RUN,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an existing run directory at --out.", rich_help_panel=_RUN),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Train in N processes on this machine (one per GPU) through torch.distributed.run.",
            rich_help_panel=_RUN,
        ),
    ] = None,
) -> None:
    """Train a GPT on your text: live progress on stderr, checkpoints in a run directory, resumable.

    Example: `minigpt train input.txt --max-time 5m`, then `minigpt generate "ROMEO:"`.
    Fine-tune on conversations (OpenAI chat JSONL or prompt/completion JSONL), in full or with LoRA:
    `minigpt train --init-from checkpoints/input chat.jsonl --lora-rank 8`, then `minigpt chat RUN`.
    Several GPUs: `minigpt train input.txt --nproc 4`, or `torchrun --nproc_per_node 4 -m minigpt train ...`.
    """
    import os

    # Before torch loads OpenMP, as for generate: a step is hundreds of parallel regions, and threads that
    # spin long between them keep each other off a shared CPU (4x4x128 steps 550-2900 ms at load 8 on the 2
    # cores, 400-560 ms with this short spin, interleaved; bench/bench_overhead.py), while idle it keeps
    # the wake-ups of never spinning off the many short gaps between regions
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    if nproc is not None and nproc > 1 and "WORLD_SIZE" in os.environ:
        raise MinigptError("--nproc starts torchrun itself; drop it under torchrun", exit_code=2)
    from minigpt.data import DataConfig
    from minigpt.panel import TrainingPanel
    from minigpt.train import TrainConfig, check_launch, parse_duration, plan_run
    from minigpt.train import train as run_training
    from minigpt.trainconfig import DEFAULT_MAX_ITERS

    model_opts = dict(
        preset=preset,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        block_size=block_size,
        dropout=dropout,
        bias=bias,
        arch=arch,
        pos=pos,
        rope_base=rope_base,
        norm=norm,
        mlp=mlp,
        qk_norm=qk_norm,
        n_kv_head=n_kv_head,
        window=window,
        window_pattern=window_pattern,
        tie=tie,
    )
    opt_opts = dict(
        batch_size=batch_size,
        grad_accum=grad_accum,
        lr=lr,
        min_lr=min_lr,
        warmup=warmup,
        schedule=schedule.value if schedule is not None else None,
        cooldown=cooldown,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        beta2=beta2,
        optimizer=optimizer.value if optimizer is not None else None,
        muon_lr=muon_lr,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=lora_targets,
        eval_every=eval_every,
        eval_iters=eval_iters,
        log_every=log_every,
        seed=seed,
        device=device,
        dtype=dtype,
        compile=compile,
    )
    budget = dict(
        max_iters=max_iters, max_time=parse_duration(max_time) if max_time else None, max_tokens=max_tokens
    )
    budget = {k: v for k, v in budget.items() if v is not None}
    data_opts = dict(
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        val_file=val_file,
        encoding=encoding,
        errors=encoding_errors,
        skip_bad_records=skip_bad_records or None,
    )
    if resume is not None:
        given = [k for k, v in {**model_opts, **opt_opts, **data_opts}.items() if v is not None]
        if given or init_from or out:
            extra = ", ".join("--" + k.replace("_", "-") for k in given) or "--out/--init-from"
            raise MinigptError(
                f"--resume continues a run with its saved settings; only budget options and the text's new "
                f"place may change (got {extra})",
                exit_code=2,
            )
        moved = DataConfig(paths=tuple(files), tokenizer="char") if files else None  # only its paths count
        run_args: dict[str, Any] = dict(
            cfg=TrainConfig(**budget), data=moved, resume=resume, allow_data_change=allow_data_change
        )
    else:
        if not files:
            raise MinigptError(
                "give a text file to train on (or --resume DIR): minigpt train FILE", exit_code=2
            )
        if init_from is not None and any(v is not None for k, v in model_opts.items() if k != "dropout"):
            raise MinigptError(
                "--init-from takes the model shape from that run; drop the shape options", exit_code=2
            )
        cfg = TrainConfig(**{k: v for k, v in {**model_opts, **opt_opts}.items() if v is not None}, **budget)
        if not cfg.has_budget:
            cfg = cfg.with_budget({"max_iters": DEFAULT_MAX_ITERS})
        data = DataConfig(
            paths=tuple(files),
            **{k: v for k, v in data_opts.items() if v is not None},
        )
        run_args = dict(cfg=cfg, data=data, out=out, init_from=init_from, overwrite=overwrite)
    if nproc is not None and nproc > 1:
        # mistakes show here as one line, not once per rank inside torchrun's failure report
        check_launch(nproc, plan_run(**run_args))
        raise typer.Exit(_launch_local(nproc, _relaunch_args(ctx.params)))
    started = (ctx.obj or {}).get("started")
    result = run_training(**run_args, reporter=TrainingPanel(), started=started)
    if result.interrupted:
        raise typer.Exit(130)


def _relaunch_args(params: dict[str, Any]) -> list[str]:
    """The `train` arguments that were given, spelled out again for the worker processes (minus --nproc)."""
    args: list[str] = []
    for name, value in params.items():
        if name in ("files", "nproc") or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif name not in ("overwrite", "allow_data_change", "skip_bad_records"):  # flags without --no-
                args.append("--no-" + flag[2:])
        else:
            # a choice (--schedule, --optimizer) by its value: str() of the enum would be its class and name
            args += [flag, value.value if isinstance(value, Enum) else str(value)]
    files = params.get("files") or []
    return args + (["--", *(str(f) for f in files)] if files else [])


def _launch_local(nproc: int, args: list[str]) -> int:
    """Run `minigpt train ARGS` as nproc processes under torch.distributed.run on this machine; its exit code.

    The launcher gets its own process group, so a Ctrl-C here reaches it once, and it stops the workers
    (they save and exit); a second Ctrl-C goes to every process, which then exit at once.
    """
    import os
    import signal
    import subprocess
    import threading

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "minigpt", "train", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, process_group=0, stderr=subprocess.PIPE, text=True, errors="replace")
    relay = threading.Thread(target=_relay_worker_output, args=(proc,), daemon=True)
    relay.start()
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        try:
            if len(received) == 1:
                proc.send_signal(signum)
            else:
                os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
        relay.join(timeout=5)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if code != 0 and not received and not getattr(proc, "reported_error", False):
        typer.echo(
            f"error: a training process failed (exit code {code}); run without --nproc to see why", err=True
        )
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


_LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")  # torch.distributed.run's own log lines


def _relay_worker_output(proc: Any) -> None:
    """Pass the workers' stderr on, but not the launcher's: its log lines and, once a worker failed, its
    traceback and failure report (the worker already said what went wrong in one line)."""
    quiet = False
    for line in proc.stderr:
        quiet = quiet or line.startswith("Traceback (most recent call last)")
        if quiet or _LAUNCHER_LOG.match(line):
            continue
        if line.startswith("error: "):
            proc.reported_error = True
        sys.stderr.write(line)
        sys.stderr.flush()


class QuantizeName(str, Enum):  # minigpt.quantize.QUANTIZATIONS, without importing torch
    none = "none"
    int8 = "int8"


@app.command("eval")
def eval_cmd(
    run: Annotated[Path, typer.Argument(help="Run directory written by `minigpt train`.")],
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Text file(s) or folders of .txt files to score, or conversation JSONL (answers only)."
        ),
    ],
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 16,
    max_windows: Annotated[
        int | None, typer.Option(min=1, help="Score at most this many evenly spaced windows (default: all).")
    ] = None,
    encoding: Annotated[str, typer.Option(help="Text encoding of the files.")] = "utf-8",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "float32",
    quantize: Annotated[
        QuantizeName, typer.Option(help="Linear layers' weights, as `minigpt generate --quantize` runs them.")
    ] = QuantizeName.none,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Loss, perplexity and bits-per-byte of a trained model on any text file, or on the assistant's
    answers in conversation JSONL (windows are then conversations)."""
    from minigpt.evaluate import evaluate_run
    from minigpt.views import eval_view, print_json

    result = evaluate_run(run, files, device, dtype, batch_size, max_windows, encoding, quantize.value)
    if as_json:
        print_json({"model": str(run), "files": [str(f) for f in files], **result.to_dict()})
        return
    from rich.console import Console

    Console().print(eval_view(result, f"{run} on {', '.join(str(f) for f in files)}"))


@app.command()
def attention(
    text: Annotated[
        str, typer.Argument(help="The text to look at (quote it; in bash $'a\\nb' gives a newline).")
    ],
    model: Annotated[
        Path | None, typer.Option("--model", help="Run directory (default: the latest under checkpoints/).")
    ] = None,
    position: Annotated[
        int | None,
        typer.Option(help="Query position to show (default: the last token; negative counts from the end)."),
    ] = None,
    layer: Annotated[
        int | None,
        typer.Option(help="Draw this layer's full T x T patterns as grids (negative from the end)."),
    ] = None,
    head: Annotated[int | None, typer.Option(help="With --layer: only this head.")] = None,
    top: Annotated[int, typer.Option(min=1, help="Top attended tokens listed per head.")] = 3,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the weights and tokens as one JSON object.")
    ] = False,
    png: Annotated[
        Path | None,
        typer.Option(
            help="Also draw the grid (one head, or a tile of heads) as a PNG (needs the viz extra)."
        ),
    ] = None,
) -> None:
    """Show which earlier tokens each attention head weights, seen from the last (or --position) token.

    By default: every layer and head's weights (in %) over the tokens, strongest in bold, then
    each head's top tokens. `--layer L` (with `--head H` for one head) draws whole causal patterns
    as grids: row = position, column = the position it attends to. Tokens show ⏎ for newline,
    ⇥ for tab, · for space and \\xNN for the bytes of a split character.

    Examples: `minigpt attention "To be, or not to be"`,
    `minigpt attention "Hello" --layer 0 --head 1 --png head.png`.
    """
    from rich.console import Console

    from minigpt.attention import DISPLAY_TOKENS, attention_maps, inspect_text, write_png
    from minigpt.engines import load_engine
    from minigpt.rundir import RunDir

    if model is None:
        model = RunDir.latest().path
        typer.echo(f"using model {model} (the latest run; pass --model DIR for another)", err=True)
    engine, tokenizer = load_engine(model, "torch", "cpu", "float32")
    seen = inspect_text(engine.model, tokenizer, text, position, layer, head)
    if seen.dropped:
        typer.echo(
            f"note: the text is {len(seen.ids) + seen.dropped} tokens, more than the model's block_size "
            f"{engine.block_size}: keeping the last {engine.block_size}",
            err=True,
        )
    if as_json:
        # one compact line: T x T weights indented one number per line would run to millions of lines
        sys.stdout.write(json.dumps(seen.to_json(str(model)), separators=(",", ":")) + "\n")
    else:
        if len(seen.ids) > DISPLAY_TOKENS:
            typer.echo(
                f"note: showing the last {DISPLAY_TOKENS} of {len(seen.ids)} positions (--json has them all)",
                err=True,
            )
        console = Console()
        for view in seen.views(str(model), console.width, top):
            console.print(view)
    if png is not None:
        maps = attention_maps(engine.model, seen.ids).weights
        layers = range(seen.n_layer) if seen.layer is None else [seen.layer]
        tiles = [(f"layer {a} head {h}", maps[a, h]) for a in layers for h in seen.heads]
        write_png(png, tiles, seen.labels)
        typer.echo(f"wrote {png}", err=True)


convert_app = typer.Typer(
    cls=_Group,
    help="Convert between Hugging Face GPT-2, Llama and Qwen3 checkpoints and minigpt runs (safetensors, "
    "no pickle).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(convert_app, name="convert")


def _report_conversion(result: Any, what: str) -> None:
    from minigpt.views import conversion_summary

    typer.echo(conversion_summary(result, what), err=True)
    if result.tokenizer_note:
        typer.echo(f"note: {result.tokenizer_note}", err=True)


@convert_app.command("from-hf")
def convert_from_hf(
    src: Annotated[
        Path,
        typer.Argument(
            help="Local Hugging Face GPT-2, Llama or Qwen3 directory (config.json + model.safetensors)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="minigpt run directory to write.")],
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="tiktoken encoding name or .tiktoken file. Default: the directory's own vocab.json + "
            "merges.txt (or tokenizer.json), else for GPT-2 r50k_base from TIKTOKEN_CACHE_DIR."
        ),
    ] = None,
    tokenizer_file: Annotated[
        Path | None,
        typer.Option(help="The r50k_base.tiktoken ranks file (or another .tiktoken file) to use."),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run at OUT.")] = False,
) -> None:
    """Import GPT-2 weights (gpt2 ... gpt2-xl, or any GPT-2 shape), or a Llama or Qwen3 model with plain
    rotary positions, as a minigpt run, offline.

    Example: `minigpt convert from-hf ./gpt2 checkpoints/gpt2`, then `minigpt params checkpoints/gpt2`
    or `minigpt train input.txt --init-from checkpoints/gpt2`.
    """
    from minigpt.convert import from_hf

    result = from_hf(src, out, tokenizer=tokenizer, tokenizer_file=tokenizer_file, overwrite=overwrite)
    _report_conversion(result, "minigpt run")


@convert_app.command("to-hf")
def convert_to_hf(
    run: Annotated[
        Path, typer.Argument(help="Run directory written by `minigpt train` or `convert from-hf`.")
    ],
    out: Annotated[Path, typer.Argument(help="Directory to write for transformers' from_pretrained.")],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Write into a non-empty OUT, replacing its model files.")
    ] = False,
) -> None:
    """Export a run for transformers' AutoModelForCausalLM.from_pretrained(OUT): GPT-2 architecture as
    GPT2LMHeadModel; rotary + RMSNorm + SwiGLU (any --n-kv-head) as LlamaForCausalLM, with --qk-norm (and
    windows) as Qwen3ForCausalLM. An option none of them holds is an error naming it.

    GPT-2 style tokenizers (r50k_base) also get vocab.json + merges.txt for GPT2Tokenizer.
    """
    from minigpt.convert import to_hf
    from minigpt.hfmap import ARCHITECTURES, family_for

    result = to_hf(run, out, overwrite=overwrite)
    _report_conversion(result, ARCHITECTURES[family_for(result.config)])


@convert_app.command("merge")
def convert_merge(
    run: Annotated[Path, typer.Argument(help="A LoRA run (trained with --lora-rank).")],
    out: Annotated[Path, typer.Option(help="The plain run directory to write.")],
    base: Annotated[
        Path | None,
        typer.Option(help="Where the base run is now, if it moved (checked by its weights' hash)."),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run at --out.")] = False,
) -> None:
    """Merge a LoRA run's adapter into its base's weights: a plain run, without the adapter's base.

    Example: `minigpt convert merge checkpoints/chat-lora --out checkpoints/chat`.
    """
    from minigpt.finetune import merge_run

    path = merge_run(run, out, base, overwrite)
    typer.echo(f"wrote {path}: {run} merged into its base", err=True)


class DeviceName(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


class ScheduleName(str, Enum):
    cosine = "cosine"
    wsd = "wsd"


class OptimizerName(str, Enum):
    adamw = "adamw"
    muon = "muon"


class BackendName(str, Enum):
    auto = "auto"
    numpy = "numpy"
    torch = "torch"


class DtypeName(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from the argument, --prompt-file, or standard input ('-')."""
    if prompt is not None and prompt_file is not None:
        raise MinigptError(
            "give the prompt either as an argument or with --prompt-file, not both", exit_code=2
        )
    if prompt_file is not None:
        if not prompt_file.is_file():
            what = "is a directory" if prompt_file.is_dir() else "does not exist"
            raise MinigptError(f"--prompt-file {prompt_file} {what}: pass a UTF-8 text file", exit_code=2)
        data, source = prompt_file.read_bytes(), str(prompt_file)
    elif prompt == "-":
        if sys.stdin.isatty():
            typer.echo("reading the prompt from standard input (end it with Ctrl-D)", err=True)
        stdin = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
        data, source = (stdin.read() if stdin else sys.stdin.read().encode("utf-8")), "standard input"
    else:
        return prompt or ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinigptError(
            f"the prompt from {source} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None


@app.command()
def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(
            help="Text to continue; '-' reads it from standard input. Empty or omitted: start from "
            "<|endoftext|> where the tokenizer has it, else from a newline."
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            "-m",
            help="Run directory written by `minigpt train` (default: the newest under checkpoints/).",
        ),
    ] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from this UTF-8 file.")] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=1, help="Tokens to generate per sample.")
    ] = 200,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", "-t", help="Divide the logits by this; 0 is greedy (and ignores --seed)."
        ),
    ] = 0.8,
    top_k: Annotated[int | None, typer.Option(help="Sample only from the k most likely tokens.")] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            help="Nucleus sampling: the smallest set of tokens with this much probability (0 < p <= 1), after --top-k."
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=SEED_MAX,
            help="Random seed: the same seed gives the same text (default: a random one, shown; unused at -t 0).",
        ),
    ] = None,
    num_samples: Annotated[
        int,
        typer.Option(
            "--num-samples",
            "-s",
            min=1,
            help="Samples drawn as one batch from one prefill, printed one after another.",
        ),
    ] = 1,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STRING", help="End a sample at this string, which is not printed (repeatable)."
        ),
    ] = None,
    stream: Annotated[
        bool | None,
        typer.Option(
            "--stream/--no-stream",
            help="Print text as it is generated, whole characters at a time (default: when stdout is a terminal).",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object: text, token counts, tokens/s and finish reason per sample."
        ),
    ] = False,
    device: Annotated[
        DeviceName, typer.Option(help="Where to run: auto picks CUDA, then MPS, then the CPU.")
    ] = DeviceName.auto,
    dtype: Annotated[
        DtypeName,
        typer.Option(
            help="Weights and KV cache type: auto is bfloat16 on CUDA, float16 on MPS, float32 on the CPU."
        ),
    ] = DtypeName.auto,
    quantize: Annotated[
        QuantizeName,
        typer.Option(
            help="Linear layers' weights: int8 reads a quarter of float32's bytes per token (torch engine, "
            "CPU; per-channel scales, activations stay in --dtype)."
        ),
    ] = QuantizeName.none,
    backend: Annotated[
        BackendName,
        typer.Option(
            help="Engine: numpy runs float32 on the CPU without importing torch (starts in a fraction of a "
            "second); torch runs on any device and dtype. auto: numpy on the CPU in float32, else torch."
        ),
    ] = BackendName.auto,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="After generating, show for each new token which earlier tokens the last layer's heads "
            "weighted most (on stderr).",
        ),
    ] = False,
    slide: Annotated[
        int | None,
        typer.Option(
            help="Context window policy past block_size: when the window is full, drop its oldest SLIDE tokens and "
            "re-read the rest in one pass (1 = always the last block_size tokens, as nanoGPT; larger = faster, "
            "shorter context right after a slide). Default: block_size // 4."
        ),
    ] = None,
) -> None:
    """Continue a prompt with a trained model: text on stdout, everything else on stderr.

    Examples: `minigpt generate "ROMEO:"`, `minigpt generate -n 500 -t 0.9 --top-p 0.95 --seed 1 "Once"`,
    `cat prompt.txt | minigpt generate - --stop $'\\n\\n' > out.txt` (in bash, $'...' makes \\n a newline).
    """
    import os
    import secrets

    # Before torch loads OpenMP: a token's work is a few hundred tiny parallel regions. Threads that spin
    # long between them keep each other off a busy CPU (5-25 tokens/s on 2 shared cores), threads that
    # never spin pay a wake-up per region (108 vs 195 tokens/s idle); a short spin keeps most of both
    # (180 idle). Measured with bench/bench_generate.py on the 6x384 model.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    from minigpt.decode import Generation, TextStream, check_sampling, encode_prompt, write_text
    from minigpt.memory import check_fits, inference_bytes
    from minigpt.rundir import RunDir

    if slide is not None and slide < 1:
        raise MinigptError(f"--slide must be at least 1, got {slide}", exit_code=2)
    check_sampling(temperature, top_k, top_p)
    stops = list(stop or [])
    TextStream(stops)  # rejects an empty stop string before any loading
    if as_json and stream:
        raise MinigptError("--json prints one object at the end: drop --stream", exit_code=2)
    text = _read_prompt(prompt, prompt_file)
    if explain and quantize != QuantizeName.none:
        raise MinigptError("--explain shows the float model's attention: drop --quantize", exit_code=2)
    model, engine, tokenizer = _load_decoder(model, backend, device, dtype, quantize, explain)
    if num_samples > 1:  # the weights are loaded and checked; the KV cache grows with the samples
        needed = inference_bytes(RunDir(model).model_config(), num_samples)
        check_fits(needed, f"{num_samples:,} samples", "lower --num-samples")
    ids = encode_prompt(tokenizer, text)
    if len(ids) > engine.block_size:
        typer.echo(
            f"warning: the prompt is {len(ids):,} tokens, longer than the model's context of "
            f"{engine.block_size}: keeping its last {engine.block_size}",
            err=True,
        )
    gen = Generation(
        engine, tokenizer, ids, max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=secrets.randbits(31) if seed is None else seed, stop=stops, slide=slide,
    )  # fmt: skip
    try:
        if as_json:
            gen.run()
            _emit_json({"model": str(model), **gen.to_json()})
            return
        write_text(gen, sys.stdout, stream=sys.stdout.isatty() if stream is None else stream)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # the reader (say `| head`) has gone: stop quietly, and keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    if explain:  # choose_backend sends --explain to torch
        _explain_tokens(engine.model, tokenizer, ids, gen.samples)
    typer.echo(gen.summary(), err=True)


def _load_decoder(
    model: Path | None,
    backend: BackendName,
    device: DeviceName,
    dtype: DtypeName,
    quantize: QuantizeName = QuantizeName.none,
    explain: bool = False,
) -> tuple[Path, Any, Any]:
    """The run (default: the newest, named on stderr), its engine as `generate` picks it, and its tokenizer."""
    import os

    from minigpt.engines import choose_backend, load_engine
    from minigpt.rundir import RunDir

    if model is None:
        model = RunDir.latest().path
        typer.echo(f"using {model}", err=True)
    engine_name = choose_backend(
        backend.value, device.value, dtype.value, explain=explain, weights=RunDir(model).weights_path,
        quantize=quantize.value,
    )  # fmt: skip
    # A decode step is a few hundred small memory-bound operations: a second thread gains little on an
    # idle CPU and, waiting at every one for a core that other work holds, costs 2-10x on a shared one
    # (bench_generate.py), for NumPy's BLAS and torch's OpenMP alike. The environment overrides both.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine, tokenizer = load_engine(model, engine_name, device.value, dtype.value, quantize.value)
    return model, engine, tokenizer


@app.command()
def chat(
    run: Annotated[
        Path | None,
        typer.Argument(
            help="Run directory fine-tuned on conversations (default: the newest under checkpoints/)."
        ),
    ] = None,
    system: Annotated[str | None, typer.Option(help="A system message that opens the conversation.")] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=1, help="The longest answer, in tokens.")
    ] = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="Divide the logits by this; 0 is greedy.")
    ] = 0.8,
    top_k: Annotated[int | None, typer.Option(help="Sample only from the k most likely tokens.")] = None,
    top_p: Annotated[
        float | None, typer.Option(help="Nucleus sampling: the smallest set with this much probability.")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            min=0, max=SEED_MAX, help="Random seed: answer n uses seed + n (default: a random one, shown)."
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(metavar="STRING", help="Also end an answer at this string (repeatable)."),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Piped input: one JSON object per answer (answer, finish_reason)."),
    ] = False,
    device: Annotated[DeviceName, typer.Option(help="Where to run, as for generate.")] = DeviceName.auto,
    dtype: Annotated[
        DtypeName, typer.Option(help="Weights and KV cache type, as for generate.")
    ] = DtypeName.auto,
    quantize: Annotated[
        QuantizeName, typer.Option(help="int8 linear layers, as for generate.")
    ] = QuantizeName.none,
    backend: Annotated[BackendName, typer.Option(help="Engine, as for generate.")] = BackendName.auto,
) -> None:
    """Chat with a run fine-tuned on conversations: answers stream as they are generated.

    On a terminal: type a message, Enter sends it; Ctrl-C stops an answer, Ctrl-D ends the chat; /reset,
    /save FILE, /help. Piped: each line of standard input is a conversation (a JSON record as in the
    training data, or a line of text as the user's message), answered on one line of its own.
    """
    import os
    import secrets

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as generate sets it, before torch loads
    from minigpt.chat.session import AnswerSettings, ChatSession
    from minigpt.chat.terminal import interactive, piped
    from minigpt.decode import TextStream, check_sampling

    check_sampling(temperature, top_k, top_p)
    TextStream(stop or [])  # rejects an empty stop string before any loading
    if seed is None and temperature > 0:
        seed = secrets.randbits(31)
        typer.echo(f"seed {seed}", err=True)
    settings = AnswerSettings(max_new_tokens, temperature, top_k, top_p, seed or 0, tuple(stop or ()))
    _, engine, tokenizer = _load_decoder(run, backend, device, dtype, quantize)
    session = ChatSession(engine, tokenizer, settings, system)
    try:
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())

            interactive(session, input, sys.stdout, sys.stderr)
        else:
            piped(session, sys.stdin.buffer, sys.stdout, system, as_json)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None


def _explain_tokens(model: Any, tokenizer: Any, prompt_ids: list[int], samples: list[Any]) -> None:
    """For every generated token, the earlier tokens each last-layer head attended to most (stderr)."""
    import shutil

    from minigpt.attention import explain_last, format_explain, token_label

    width = shutil.get_terminal_size().columns
    for n, sample in enumerate(samples):
        if len(samples) > 1:
            typer.echo(f"sample {n + 1}:", err=True)
        context = list(prompt_ids)
        for token in sample.token_ids:
            focus = explain_last(model, context, tokenizer, top=3)
            typer.echo(
                f"{token_label(tokenizer.decode_bytes([token])):>8} ← {format_explain(focus, width, 11)}",
                err=True,
            )
            context.append(token)


@app.command()
def demo(
    max_time: Annotated[str, typer.Option(help="Training time budget, e.g. 90s, 2m, 10m.")] = "2m",
    out: Annotated[
        Path, typer.Option(help="Run directory for the demo model (replaced on each demo).")
    ] = Path("checkpoints/demo"),
    tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate at the end.")] = 300,
    seed: Annotated[int, typer.Option(help="Seed for training and sampling.")] = 1337,
) -> None:
    """Train on Python's own documentation (no file needed), generate from the model, count its parameters.

    The same three steps as `minigpt train FILE`, `minigpt generate` and `minigpt params RUN`.
    """
    from minigpt.demo import DEMO_PROMPT, generate_demo_text, show_demo_params, train_demo
    from minigpt.panel import TrainingPanel
    from minigpt.train import parse_duration

    result = train_demo(out, parse_duration(max_time), seed, TrainingPanel())
    if result.interrupted:
        raise typer.Exit(130)
    typer.echo(f"\n== 2/3 generating {tokens} tokens from {out} after the prompt {DEMO_PROMPT!r}", err=True)
    generate_demo_text(out, tokens, seed, sys.stdout)
    typer.echo(f"\n== 3/3 parameters of {out}", err=True)
    show_demo_params(out)


def main() -> None:
    app()


@app.command()
def serve(
    run: Annotated[
        Path | None, typer.Argument(help="Run directory to serve (default: the newest under checkpoints/).")
    ] = None,
    model: Annotated[
        list[Path] | None,
        typer.Option(
            "--model",
            "-m",
            metavar="RUN",
            help="Another run to serve (repeatable); a request picks one by folder name.",
        ),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on: 127.0.0.1 keeps the server to this machine; 0.0.0.0 opens it to "
            "the network (then use --api-key behind a TLS proxy)."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MINIGPT_API_KEY",
            show_envvar=True,
            help="Require `Authorization: Bearer KEY` on every /v1 route.",
        ),
    ] = None,
    backend: Annotated[
        BackendName, typer.Option(help="Engine, as for generate: auto is numpy on the CPU in float32.")
    ] = BackendName.auto,
    device: Annotated[DeviceName, typer.Option(help="Where to run (the torch engine).")] = DeviceName.auto,
    dtype: Annotated[DtypeName, typer.Option(help="Weights and KV cache type (the torch engine).")] = (
        DtypeName.auto
    ),
    max_batch: Annotated[
        int, typer.Option(min=1, help="Rows (samples of all requests) decoded together at most; caps n.")
    ] = 32,
    queue: Annotated[
        int, typer.Option(min=0, help="Requests that may wait for free rows; past that, 429 (busy).")
    ] = 64,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="The largest max_tokens a request may ask for.")
    ] = 1024,
) -> None:
    """Serve runs over an OpenAI-compatible API (/v1/completions, /v1/models) with a web page at /.

    Examples: `minigpt serve`, `minigpt serve checkpoints/a --model checkpoints/b --port 8080`,
    then `curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:"}'`.
    """
    import os

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as generate sets them, before torch or NumPy load
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MinigptError(
            "minigpt serve needs FastAPI and uvicorn: pip install 'minigpt[serve]' "
            "(pip install -e '.[serve]' in a checkout)"
        ) from None
    from minigpt.rundir import RunDir
    from minigpt.serve.models import load_models
    from minigpt.serve.protocol import Limits
    from minigpt.serve.server import run_server

    paths = ([run] if run is not None else []) + list(model or [])
    if not paths:
        paths = [RunDir.latest().path]
        typer.echo(f"using {paths[0]}", err=True)
    models = load_models(
        paths, backend.value, device.value, dtype.value, max_rows=max_batch, max_waiting=queue
    )
    run_server(models, host, port, api_key or None, Limits(max_tokens=max_tokens, max_n=max_batch))
