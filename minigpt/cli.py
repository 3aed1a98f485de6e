"""The `minigpt` command line: parse typed options, build configs, call the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from minigpt import __version__
from minigpt.errors import MinigptError


class _Group(TyperGroup):
    """Print a MinigptError as one line on stderr and exit with its code, never a traceback."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except MinigptError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None


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
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Train, sample and inspect small GPT-style language models.

    minigpt train FILE      train a model on your text (checkpoints under checkpoints/)
    minigpt generate TEXT   continue TEXT with the latest model
    minigpt params          parameter breakdown of a run, a preset or any shape
    """


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


@app.command()
def params(
    run: Annotated[
        Path | None,
        typer.Argument(help="A run directory written by `minigpt train` (omit to count a preset or shape)."),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="Named shape: tiny, mini, small, gpt2[-medium|-large|-xl], gpt3-small ... gpt3-175b."
        ),
    ] = None,
    n_layer: Annotated[int | None, typer.Option(help="Number of transformer blocks.")] = None,
    n_head: Annotated[int | None, typer.Option(help="Attention heads per block.")] = None,
    n_embd: Annotated[int | None, typer.Option(help="Model width d_model (divisible by n_head).")] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary size (default 50,257, GPT-2's BPE).")
    ] = None,
    block_size: Annotated[int | None, typer.Option(help="Context length in tokens.")] = None,
    bias: Annotated[
        bool | None, typer.Option("--bias/--no-bias", help="Biases in Linear and LayerNorm layers.")
    ] = None,
    tied: Annotated[
        bool | None, typer.Option("--tied/--untied", help="Share the unembedding with the token embedding.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """GPT-3 style parameter breakdown, reconciled with the module, plus memory, FLOPs and KV cache.

    Examples: `minigpt params --preset gpt3-175b`, `minigpt params --n-layer 6 --n-head 6 --n-embd 384
    --vocab-size 65 --block-size 256`, `minigpt params checkpoints/demo`.
    """
    from minigpt.config import GPTConfig
    from minigpt.params import count_params
    from minigpt.presets import GPT2_VOCAB
    from minigpt.presets import preset as get_preset

    overrides = {
        k: v
        for k, v in dict(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            vocab_size=vocab_size,
            block_size=block_size,
            bias=bias,
            tie_embeddings=tied,
        ).items()
        if v is not None
    }
    stored: int | None = None
    if run is not None:
        from minigpt.checkpoint import WEIGHTS_FILE, read_run_config, run_model_config, stored_param_count

        if preset or overrides:
            raise MinigptError("give either a run directory or shape options, not both", exit_code=2)
        config = run_model_config(read_run_config(run), run)
        stored = stored_param_count(run / WEIGHTS_FILE)
        title = str(run)
    else:
        fields: dict[str, Any] = {"vocab_size": GPT2_VOCAB}
        if preset:
            fields.update(get_preset(preset))
        fields.update(overrides)
        config = GPTConfig(**fields)
        title = preset or "custom shape"
    report = count_params(config)
    if as_json:
        out = report.to_dict()
        out["name"] = title
        if stored is not None:
            out["stored_total"] = stored
        _emit_json(out)
        return
    from minigpt.render import print_params

    print_params(report, title, stored)


_MODEL = "Model shape"
_DATA = "Data and tokenizer"
_OPT = "Optimisation"
_BUDGET = "Budget (the first reached stops)"
_EVAL = "Evaluation and logging"
_RUN = "Run"


@app.command()
def train(
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
            help="Model shape preset: tiny, mini, small, gpt2, ... [default: mini]", rich_help_panel=_MODEL
        ),
    ] = None,
    n_layer: Annotated[
        int | None, typer.Option(help="Transformer blocks (overrides the preset).", rich_help_panel=_MODEL)
    ] = None,
    n_head: Annotated[
        int | None, typer.Option(help="Attention heads per block.", rich_help_panel=_MODEL)
    ] = None,
    n_embd: Annotated[
        int | None, typer.Option(help="Model width (divisible by --n-head).", rich_help_panel=_MODEL)
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(help="Context length in tokens.", rich_help_panel=_MODEL)
    ] = None,
    dropout: Annotated[
        float | None, typer.Option(help="Dropout probability in [0, 1). [default: 0]", rich_help_panel=_MODEL)
    ] = None,
    bias: Annotated[
        bool | None,
        typer.Option(
            "--bias/--no-bias",
            help="Biases in Linear and LayerNorm layers. [default: bias]",
            rich_help_panel=_MODEL,
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="char, bpe (trained on your text), gpt2/r50k_base/p50k_base/cl100k_base/o200k_base, or a .tiktoken file. [default: char]",
            rich_help_panel=_DATA,
        ),
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary size for --tokenizer bpe.", rich_help_panel=_DATA)
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option(
            help="Last fraction of the text held out for validation. [default: 0.1]", rich_help_panel=_DATA
        ),
    ] = None,
    val_file: Annotated[
        Path | None,
        typer.Option(help="Validate on this text instead of a held-out fraction.", rich_help_panel=_DATA),
    ] = None,
    encoding: Annotated[
        str | None,
        typer.Option(help="Text encoding of the input files. [default: utf-8]", rich_help_panel=_DATA),
    ] = None,
    replace_invalid: Annotated[
        bool,
        typer.Option(
            "--replace-invalid",
            help="Replace undecodable bytes instead of stopping with an error.",
            rich_help_panel=_DATA,
        ),
    ] = False,
    batch_size: Annotated[
        int | None, typer.Option(help="Sequences per micro-batch (per process).", rich_help_panel=_OPT)
    ] = None,
    grad_accum: Annotated[
        int | None, typer.Option(help="Micro-batches accumulated per optimizer step.", rich_help_panel=_OPT)
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.", rich_help_panel=_OPT)] = None,
    min_lr: Annotated[
        float | None, typer.Option(help="Learning rate at the end of the cosine decay.", rich_help_panel=_OPT)
    ] = None,
    warmup: Annotated[int | None, typer.Option(help="Linear warmup steps.", rich_help_panel=_OPT)] = None,
    weight_decay: Annotated[
        float | None, typer.Option(help="AdamW weight decay on weight matrices.", rich_help_panel=_OPT)
    ] = None,
    grad_clip: Annotated[
        float | None, typer.Option(help="Clip the gradient norm to this (0: off).", rich_help_panel=_OPT)
    ] = None,
    beta2: Annotated[float | None, typer.Option(help="AdamW beta2.", rich_help_panel=_OPT)] = None,
    max_iters: Annotated[
        int | None, typer.Option(help="Stop after this many optimizer steps.", rich_help_panel=_BUDGET)
    ] = None,
    max_time: Annotated[
        str | None,
        typer.Option(help="Stop after this much wall time, e.g. 90s, 10m, 1h30m.", rich_help_panel=_BUDGET),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Stop after this many training tokens.", rich_help_panel=_BUDGET)
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="Evaluate (and checkpoint) every N steps.", rich_help_panel=_EVAL)
    ] = None,
    eval_iters: Annotated[
        int | None, typer.Option(help="Batches per evaluation.", rich_help_panel=_EVAL)
    ] = None,
    log_every: Annotated[
        int | None, typer.Option(help="Log the training loss every N steps.", rich_help_panel=_EVAL)
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed (weights, batches, dropout).", rich_help_panel=_RUN)
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto, cpu, cuda or mps. [default: auto]", rich_help_panel=_RUN)
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="auto, float32, bfloat16 or float16 (autocast). [default: auto]", rich_help_panel=_RUN
        ),
    ] = None,
    compile: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the model. [default: no-compile]",
            rich_help_panel=_RUN,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory to write. [default: checkpoints/<first file's name>]", rich_help_panel=_RUN
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue this run with its saved settings (budget options may be raised).",
            rich_help_panel=_RUN,
        ),
    ] = None,
    init_from: Annotated[
        Path | None,
        typer.Option(
            help="Start from this run's weights and tokenizer, with a fresh optimizer.", rich_help_panel=_RUN
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an existing run directory at --out.", rich_help_panel=_RUN),
    ] = False,
) -> None:
    """Train a GPT on your text: live progress on stderr, checkpoints in a run directory, resumable.

    Example: `minigpt train input.txt --max-time 5m`, then `minigpt generate "ROMEO:"`.
    """
    from minigpt.data import DataConfig
    from minigpt.train import TrainConfig, parse_duration
    from minigpt.train import train as run_training

    model_opts = dict(
        preset=preset,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        block_size=block_size,
        dropout=dropout,
        bias=bias,
    )
    opt_opts = dict(
        batch_size=batch_size,
        grad_accum=grad_accum,
        lr=lr,
        min_lr=min_lr,
        warmup=warmup,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        beta2=beta2,
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
    )
    if resume is not None:
        given = [k for k, v in {**model_opts, **opt_opts, **data_opts}.items() if v is not None]
        if files or given or init_from or replace_invalid or out:
            extra = ", ".join("--" + k.replace("_", "-") for k in given) or "files/--out/--init-from"
            raise MinigptError(
                f"--resume continues a run with its saved settings; only budget options may change (got {extra})",
                exit_code=2,
            )
        result = run_training(TrainConfig(), resume=resume, budget_overrides=budget)
    else:
        if not files:
            raise MinigptError(
                "give a text file to train on (or --resume DIR): minigpt train FILE", exit_code=2
            )
        if init_from is not None and any(v is not None for k, v in model_opts.items() if k != "dropout"):
            raise MinigptError(
                "--init-from takes the model shape from that run; drop the shape options", exit_code=2
            )
        cfg_fields = {k: v for k, v in {**model_opts, **opt_opts, **budget}.items() if v is not None}
        cfg = TrainConfig(**cfg_fields)
        if not cfg.has_budget:
            cfg = TrainConfig(**{**cfg_fields, "max_iters": 2000})
        data = DataConfig(
            paths=tuple(files),
            errors="replace" if replace_invalid else "strict",
            **{k: v for k, v in data_opts.items() if v is not None},
        )
        result = run_training(cfg, data, out=out, init_from=init_from, overwrite=overwrite)
    if result.interrupted:
        raise typer.Exit(130)


def main() -> None:
    app()
