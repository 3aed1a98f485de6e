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
        typer.Option(help="Also draw the grid (one head, or a tile of heads) as a PNG (needs the viz extra)."),
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

    from minigpt.attention import (
        DISPLAY_TOKENS,
        attention_maps,
        attention_row,
        grid_view,
        position_view,
        resolve_index,
        token_labels,
        write_png,
    )
    from minigpt.checkpoint import latest_run, load_run

    if head is not None and layer is None:
        raise MinigptError("--head needs --layer: give both, e.g. --layer 0 --head 1", exit_code=2)
    if not text:
        raise MinigptError("TEXT is empty: give some text to look at", exit_code=2)
    if model is None:
        model = latest_run()
        typer.echo(f"using model {model} (the latest run; pass --model DIR for another)", err=True)
    gpt, tokenizer, _ = load_run(model)
    config = gpt.config
    ids = tokenizer.encode(text)
    dropped = max(0, len(ids) - config.block_size)
    if dropped:
        ids = ids[dropped:]
        typer.echo(
            f"note: the text is {len(ids) + dropped} tokens, more than the model's block_size "
            f"{config.block_size}: keeping the last {len(ids)}",
            err=True,
        )
    pos = resolve_index(-1 if position is None else position, len(ids), "position", "tokens")
    li = None if layer is None else resolve_index(layer, config.n_layer, "layer", "layers")
    heads = (
        list(range(config.n_head)) if head is None else [resolve_index(head, config.n_head, "head", "heads")]
    )
    ids = ids[: pos + 1]  # causal: tokens after pos change nothing at or before it
    labels = token_labels(tokenizer, ids)
    if len(ids) > DISPLAY_TOKENS and not as_json:
        typer.echo(
            f"note: showing the last {DISPLAY_TOKENS} of {len(ids)} positions (--json has them all)", err=True
        )
    console = Console()
    out: dict[str, Any] = {
        "model": str(model),
        "ids": ids,
        "tokens": [tokenizer.decode_bytes([i]).decode("utf-8", errors="backslashreplace") for i in ids],
        "dropped": dropped,
        "position": pos,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
    }
    if li is None:
        row = attention_row(gpt, ids)  # (L, H, pos + 1)
        out["weights"] = [[[round(w, 6) for w in r] for r in hs] for hs in row.tolist()]
        title = (
            f"Attention from position {pos} ({labels[pos]}) over positions 0..{pos}, in %: "
            f"{config.n_layer} layers × {config.n_head} heads of {model}"
        )
        if not as_json:
            console.print(position_view(row, labels, title, console.width, top=top))
    else:
        grid = attention_maps(gpt, ids).weights[li]  # (H, T, T)
        out["layer"] = li
        weights = [[[round(w, 6) for w in r] for r in grid[h].tolist()] for h in heads]
        if head is None:
            out["weights"] = weights
        else:
            out["head"], out["weights"] = heads[0], weights[0]
        for h in [] if as_json else heads:
            title = f"Layer {li}, head {h} of {model}: row = position, column = the position it attends to"
            console.print(grid_view(grid[h], labels, title, console.width))
    if as_json:
        # one compact line: T x T weights indented one number per line would run to millions of lines
        sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
    if png is not None:
        maps = attention_maps(gpt, ids).weights
        layers = range(config.n_layer) if li is None else [li]
        write_png(png, [(f"layer {a} head {h}", maps[a, h]) for a in layers for h in heads], labels)
        typer.echo(f"wrote {png}", err=True)


def main() -> None:
    app()
