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
        Path | None, typer.Argument(help="A run directory written by `minigpt train` (omit to count a preset or shape).")
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="Named shape: tiny, mini, small, gpt2[-medium|-large|-xl], gpt3-small ... gpt3-175b.")
    ] = None,
    n_layer: Annotated[int | None, typer.Option(help="Number of transformer blocks.")] = None,
    n_head: Annotated[int | None, typer.Option(help="Attention heads per block.")] = None,
    n_embd: Annotated[int | None, typer.Option(help="Model width d_model (divisible by n_head).")] = None,
    vocab_size: Annotated[int | None, typer.Option(help="Vocabulary size (default 50,257, GPT-2's BPE).")] = None,
    block_size: Annotated[int | None, typer.Option(help="Context length in tokens.")] = None,
    bias: Annotated[bool | None, typer.Option("--bias/--no-bias", help="Biases in Linear and LayerNorm layers.")] = None,
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
    from minigpt.presets import GPT2_VOCAB, preset as get_preset

    overrides = {
        k: v
        for k, v in dict(
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size,
            bias=bias, tie_embeddings=tied,
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


def main() -> None:
    app()
