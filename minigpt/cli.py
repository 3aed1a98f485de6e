"""The `minigpt` command line: parse typed options, build configs, call the library."""

from __future__ import annotations

import json
import sys
from enum import Enum
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


class DeviceName(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


class DtypeName(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


SAMPLE_SEPARATOR = "\n---------------\n"


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
        int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per sample.")
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
        typer.Option(help="Random seed: the same seed gives the same text (default: a random one, shown)."),
    ] = None,
    num_samples: Annotated[
        int,
        typer.Option(
            "--num-samples",
            "-s",
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
    `cat prompt.txt | minigpt generate - --stop "\\n\\n" > out.txt`.
    """
    import os
    import secrets

    # Before torch loads OpenMP: idle threads sleep instead of spinning. A token's work is a few hundred
    # tiny parallel regions, and on a CPU that other processes also use, spinning threads keep each other
    # off the cores: 5-25 tokens/s instead of ~110 on 2 busy cores (bench/bench_generate.py, this repo).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from minigpt.checkpoint import latest_run, load_run
    from minigpt.device import resolve_device, resolve_dtype
    from minigpt.sampling import Generation, TextStream, check_sampling, encode_prompt, resolve_slide

    if max_new_tokens < 1:
        raise MinigptError(f"--max-new-tokens must be at least 1, got {max_new_tokens}", exit_code=2)
    if num_samples < 1:
        raise MinigptError(f"--num-samples must be at least 1, got {num_samples}", exit_code=2)
    if slide is not None and slide < 1:
        raise MinigptError(f"--slide must be at least 1, got {slide}", exit_code=2)
    check_sampling(temperature, top_k, top_p)
    stops = list(stop or [])
    TextStream(stops)  # rejects an empty stop string before any loading
    if as_json and stream:
        raise MinigptError("--json prints one object at the end: drop --stream", exit_code=2)
    text = _read_prompt(prompt, prompt_file)
    torch_device = resolve_device(device.value)
    torch_dtype = resolve_dtype(dtype.value, torch_device)
    if model is None:
        model = latest_run()
        typer.echo(f"using {model}", err=True)
    gpt, tokenizer, _ = load_run(model, str(torch_device))
    gpt.to(torch_dtype)
    block_size = gpt.config.block_size
    slide = resolve_slide(slide, block_size)
    ids = encode_prompt(tokenizer, text)
    if len(ids) > block_size:
        typer.echo(
            f"warning: the prompt is {len(ids):,} tokens, longer than the model's context of {block_size}: "
            f"keeping its last {block_size}",
            err=True,
        )
    if seed is None:
        seed = secrets.randbits(31)
    gen = Generation(
        gpt, tokenizer, ids, max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, stop=stops, slide=slide,
    )  # fmt: skip
    if stream is None:
        stream = not as_json and sys.stdout.isatty()
    out = sys.stdout
    shown = 0  # the sample being streamed; later ones wait in `pending` until it is done
    pending = [""] * num_samples
    finished = [False] * num_samples
    try:
        for event in gen.events():
            if not stream:
                continue
            if event.sample == shown:
                out.write(event.text)
            else:
                pending[event.sample] += event.text
            finished[event.sample] |= event.done
            while shown < num_samples and finished[shown]:
                shown += 1
                if shown < num_samples:
                    out.write(SAMPLE_SEPARATOR + pending[shown])
            out.flush()
        samples = gen.samples
        if as_json:
            _emit_json(
                {
                    "model": str(model),
                    "prompt_tokens": len(ids),
                    "seed": seed,
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "device": str(torch_device),
                    "dtype": str(torch_dtype).removeprefix("torch."),
                    "time_to_first_token_s": round(gen.time_to_first_token, 4),
                    "seconds": round(gen.seconds, 4),
                    "tokens_per_second": round(gen.tokens_per_second, 2),
                    "samples": [
                        {
                            "text": s.text,
                            "completion_tokens": len(s.token_ids),
                            "tokens_per_second": round(s.tokens_per_second, 2),
                            "finish_reason": s.finish_reason,
                        }
                        for s in samples
                    ],
                }
            )
            return
        if not stream:
            out.write(SAMPLE_SEPARATOR.join(s.text for s in samples))
        if out.isatty():
            out.write("\n")  # keep the shell prompt off the last line; redirected output stays exact
        out.flush()
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # the reader (say `| head`) has gone: stop quietly, and keep Python from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    total = sum(len(s.token_ids) for s in samples)
    typer.echo(
        f"{total:,} tokens in {gen.seconds:.2f} s ({gen.tokens_per_second:,.1f} tokens/s, first after "
        f"{gen.time_to_first_token * 1000:.0f} ms), seed {seed}",
        err=True,
    )


def main() -> None:
    app()
