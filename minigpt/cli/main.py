"""The `minigpt` command line: parse typed options, build configs, call the library."""

from __future__ import annotations

import contextlib
import difflib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from typer._click import exceptions as click_errors  # typer vendors click as typer._click
from typer.core import TyperGroup

from minigpt import __version__
from minigpt.analysis.attention_config import AttentionConfig
from minigpt.analysis.eval_config import EvalConfig
from minigpt.chat.config import ChatConfig
from minigpt.cli.demo import DemoConfig
from minigpt.cli.typer_options import command_line, with_options
from minigpt.common import startup
from minigpt.common.settings import NO_OPTIONS, Given, Option, options_of
from minigpt.convert.config import GGUFConfig, ImportConfig, MergeConfig, OverwriteConfig
from minigpt.data.config import DataConfig
from minigpt.errors import Interrupted, MinigptError
from minigpt.generate.config import EngineConfig, GenerateConfig, GenerateIOConfig, read_prompt
from minigpt.model.config import GPTConfig
from minigpt.runs.folder import DEFAULT_ROOT
from minigpt.serve.config import ServeConfig
from minigpt.train.budget import process_started
from minigpt.train.config import BUDGET_SETTINGS, LaunchConfig, TrainConfig


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
    message = " ".join(e.format_message().replace("Value error, ", "").split())  # typer's prefix for choices
    if ctx is not None and hasattr(ctx.command, "list_commands") and message.startswith("No such command"):
        given = message.split("'")[1] if "'" in message else ""
        guess = _closest(given, list(ctx.command.list_commands(ctx)))
        return f"unknown command {given!r}{f': did you mean {guess!r}?' if guess else ''} ({where})"
    return f"{message[:1].lower()}{message[1:]} ({where})"


def _plain_flags(command: Any, ctx: Any) -> None:
    """Show a command's on/off flags without a value: typer writes `--json <bool>`, as if `--json true`
    were valid."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False):
            param.metavar = ""


# `minigpt --help` lists the commands in this order: try it, train, use the model, look inside, then the rest
WORKFLOW = ("demo", "train", "generate", "chat", "params", "eval", "attention", "prepare", "runs", "convert",
            "serve")  # fmt: skip


class _Group(TyperGroup):
    """Errors as one line on stderr, never a traceback or a box: a MinigptError with its exit code, a
    usage error (unknown option, bad value, missing argument) with exit code 2 and the closest valid name;
    Ctrl-C as what it ended (an Interrupted's message, else "interrupted") with exit code 130. Its help and
    its commands' show on/off flags as flags."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _plain_flags(command, ctx)
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _plain_flags(self, ctx)
        super().format_help(ctx, formatter)

    def list_commands(self, ctx: Any) -> list[str]:
        """The commands in the order a new user meets them (WORKFLOW), any others after."""
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: WORKFLOW.index(n) if n in WORKFLOW else len(WORKFLOW))

    def invoke(self, ctx: Any) -> Any:
        startup.settle()
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:  # typer would exit with 130 and say nothing
            typer.echo(str(e) if isinstance(e, Interrupted) else "\ninterrupted", err=True)
            raise typer.Exit(130) from None
        except MinigptError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None
        except (MemoryError, RuntimeError) as e:  # torch's out-of-memory errors are RuntimeErrors
            from minigpt.model.memory import allocation_error, is_allocation_failure

            if not is_allocation_failure(e):
                raise
            typer.echo(f"error: {allocation_error(e, ctx.invoked_subcommand)}", err=True)
            raise typer.Exit(1) from None

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

    Start here: minigpt demo   (trains for two minutes, no file needed)
    Then on your own text:
      minigpt train FILE --max-time 5m   train a model (under checkpoints/)
      minigpt generate "TEXT"            continue TEXT with the newest run
      minigpt params                     its parameters, memory and FLOPs
    """
    # `train --max-time` is the wall time of the whole command: from the process's start when main() runs
    # it (the interpreter's start-up and imports count), else from here
    ctx.obj = ctx.obj or {"started": time.perf_counter()}


RunOption = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "-m",
        help="Run directory written by `minigpt train` (default: the newest under checkpoints/).",
    ),
]


# how a command that defaults to the newest run takes another: the error when there is none says so
_NAME_MODEL = "pass --model DIR"
_NAME_RUN = "name a run: `minigpt {} RUN`"


def _json_option(what: str) -> Any:
    """The --json flag of a command that prints `what` instead of its tables."""
    return typer.Option("--json", help=f"Print {what}.")


# `params` counts a model as `train` builds one, but without a run it has no device recipe: no preset is
# GPTConfig's own shape (GPT-2's) and no arch GPT-2's choices
_PARAMS_MODEL = tuple(o.with_label("gpt2") for o in options_of(TrainConfig) if o.name in ("preset", "arch"))


@app.command()
@with_options(_PARAMS_MODEL, options_of(GPTConfig, skip=("dropout", "rope_base")))
def params(
    run: Annotated[
        Path | None,
        typer.Argument(help="A run directory written by `minigpt train` (omit to count a preset or shape)."),
    ] = None,
    given: Given = NO_OPTIONS,
    as_json: Annotated[bool, _json_option("one JSON object instead of tables")] = False,
) -> None:
    """GPT-3 style parameter breakdown, reconciled with the module, plus memory, FLOPs and KV cache.

    Without arguments: the newest run under checkpoints/. Examples: `minigpt params --preset gpt3-175b`,
    `minigpt params --n-layer 6 --n-head 6 --n-embd 384 --vocab-size 65 --block-size 256`,
    `minigpt params --preset small --arch modern --mlp swiglu --n-kv-head 2 --window 64`,
    `minigpt params checkpoints/demo`.
    """
    from minigpt.cli.views import print_json, print_params, trained_with, training_summary
    from minigpt.model.params import count_params
    from minigpt.model.presets import model_config
    from minigpt.runs.folder import RunDir
    from minigpt.runs.summary import summarize

    if run is not None and given.values:
        raise MinigptError("give either a run directory or shape options, not both", exit_code=2)
    if given.values:
        name = given.values.get("preset") or "custom shape"
        report = count_params(
            model_config(given.values.get("preset"), given.values.get("arch"), **given.of(GPTConfig))
        )
        if as_json:
            print_json({**report.to_dict(), "name": name})
        else:
            print_params(report, name)
        return
    rundir = RunDir(run) if run is not None else RunDir.latest(name_one=_NAME_RUN.format("params"))
    summary = summarize(rundir)
    report = count_params(RunDir(summary.path).model_config())
    if as_json:
        print_json({**report.to_dict(), "name": summary.path, "stored_total": summary.params,
                    "run": summary.to_dict()})  # fmt: skip
    else:
        optimizer = trained_with(RunDir(summary.path))
        print_params(report, summary.path, summary.params, training_summary(summary), optimizer=optimizer)


@app.command()
def runs(
    root: Annotated[Path, typer.Argument(help="The folder that holds the run directories.")] = DEFAULT_ROOT,
    as_json: Annotated[bool, _json_option("a JSON list instead of a table")] = False,
) -> None:
    """List the runs under a folder, newest first: data, tokenizer, shape, steps, best loss, age."""
    from minigpt.cli.views import print_json, runs_view, show
    from minigpt.runs.summary import list_runs

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

    console = Console()
    show(runs_view(summaries, f"Runs under {root}", console.width if console.is_terminal else None), console)


@app.command()
@with_options(options_of(TrainConfig), options_of(DataConfig), options_of(LaunchConfig))
def train(
    ctx: typer.Context,
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Files and folders of text, JSON lines or Parquet (also compressed) to train on, or conversation "
            "JSONL to fine-tune on (omit with --resume).",
            show_default=False,
        ),
    ] = None,
    given: Given = NO_OPTIONS,
) -> None:
    """Train a GPT on your text: live progress on stderr, checkpoints in a run directory, resumable.

    Example: `minigpt train input.txt --max-time 5m`, then `minigpt generate "ROMEO:"`.
    Fine-tune on conversations (OpenAI chat JSONL or prompt/completion JSONL), in full or with LoRA:
    `minigpt train --init-from checkpoints/input chat.jsonl --lora-rank 8`, then `minigpt chat RUN`.
    Several GPUs: `minigpt train input.txt --nproc 4`, or `torchrun --nproc_per_node 4 -m minigpt train ...`.
    """
    from minigpt.train import spin

    launch = _launch(given)
    cfg = TrainConfig(**given.of(TrainConfig))
    spin.choose(cfg, launch.processes)  # before torch loads OpenMP, which reads it once
    with startup.loading():  # torch's import: no collector passes over it (minigpt.common.startup)
        from minigpt.cli.training_display import TrainingDisplay
        from minigpt.train.loop import check_launch, command_arguments, plan_run
        from minigpt.train.loop import train as run_training

    resumed = launch.resume is not None
    changed = given.flags(skip=(*BUDGET_SETTINGS, *LaunchConfig.WITH_RESUME)) if resumed else []
    run_args = command_arguments(files, cfg, given.of(DataConfig), launch, changed)
    if launch.processes > 1:
        from minigpt.train.distributed import launch_local

        # mistakes show here as one line, not once per rank inside torchrun's failure report
        check_launch(launch.processes, plan_run(**run_args))
        raise typer.Exit(launch_local(launch.processes, command_line(ctx, skip=("nproc",))))
    result = run_training(**run_args, reporter=TrainingDisplay(), started=(ctx.obj or {}).get("started"))
    if result.interrupted:
        raise typer.Exit(130)


@app.command()
@with_options(options_of(DataConfig), options_of(LaunchConfig, skip=LaunchConfig.RUN_ONLY))
def prepare(
    ctx: typer.Context,
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Files and folders of text, JSON lines or Parquet (also compressed).", show_default=False
        ),
    ],
    given: Given = NO_OPTIONS,
) -> None:
    """Tokenize a corpus ahead of training: `train` then reuses it and starts at once.

    Takes `train`'s data options. Under torchrun (`--nproc N`, or several machines) the processes split the
    files between them.
    """
    launch = _launch(given)
    data = DataConfig(paths=tuple(files), **given.of(DataConfig))
    if launch.processes > 1:
        from minigpt.train.distributed import launch_local

        raise typer.Exit(launch_local(launch.processes, command_line(ctx, skip=("nproc",)), "prepare"))
    from minigpt.data.prepare import prepare as run_prepare

    done = run_prepare(data)
    if done.master:
        typer.echo(done.describe())


@app.command("eval")
@with_options(options_of(EvalConfig), options_of(EngineConfig, skip=("backend", "dtype", "kv_cache")))
def eval_cmd(
    run: Annotated[Path, typer.Argument(help="Run directory written by `minigpt train`.")],
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Text file(s) or folders of .txt files to score, conversation JSONL (answers only), or tasks "
            "JSONL (answers generated and scored)."
        ),
    ],
    given: Given = NO_OPTIONS,
    as_json: Annotated[bool, _json_option("one JSON object instead of a table")] = False,
) -> None:
    """Loss, perplexity and bits-per-byte of a trained model on text, or on conversations' answers.

    Any text file, or the assistant's answers in conversation JSONL (windows are then conversations).
    Tasks (JSONL of {"prompt", "answer"}, what `train --reward` learns from): the mean reward of greedy
    answers (exact match by default), and pass@k with `--samples k`.
    """
    _quiet_openmp()
    from minigpt.analysis.evaluate import evaluate_run
    from minigpt.cli.views import eval_view, print_json, show, task_eval_view
    from minigpt.corpus.progress import Progress
    from minigpt.feedback.task_eval import evaluate_tasks, holds_tasks

    cfg, run_on = EvalConfig(**given.of(EvalConfig)), EngineConfig(**given.of(EngineConfig))
    title = f"{run} on {', '.join(str(f) for f in files)}"
    if holds_tasks(files, cfg):
        score = evaluate_tasks(run, files, cfg, run_on.device, run_on.quantize)
        if as_json:
            print_json({"model": str(run), "files": [str(f) for f in files], **score.to_dict()})
        else:
            show(task_eval_view(score, title))
        return
    result = evaluate_run(run, files, cfg, run_on.device, run_on.quantize, Progress(True))
    if as_json:
        print_json({"model": str(run), "files": [str(f) for f in files], **result.to_dict()})
        return
    show(eval_view(result, title))


@app.command()
@with_options(options_of(AttentionConfig))
def attention(
    text: Annotated[
        str, typer.Argument(help="The text to look at (quote it; in bash $'a\\nb' gives a newline).")
    ],
    model: RunOption = None,
    given: Given = NO_OPTIONS,
    as_json: Annotated[bool, _json_option("the weights and tokens as one JSON object")] = False,
) -> None:
    """Show which earlier tokens each attention head weights, seen from the last (or --position) token.

    By default: every layer and head's weights (in %) over the tokens, strongest in bold, then
    each head's top tokens. `--layer L` (with `--head H` for one head) draws whole causal patterns
    as grids: row = position, column = the position it attends to. Tokens show ⏎ for newline,
    ⇥ for tab, · for space and \\xNN for the bytes of a split character.

    Examples: `minigpt attention "To be, or not to be"`,
    `minigpt attention "Hello" --layer 0 --head 1 --png head.png`.
    """
    from minigpt.analysis.attention_views import show_attention

    cfg = AttentionConfig(**given.of(AttentionConfig))  # a bad option is reported before a missing run
    show_attention(_run_or_latest(model, _NAME_MODEL), text, cfg, as_json)


convert_app = typer.Typer(
    cls=_Group,
    help="Convert between Hugging Face GPT-2, Llama and Qwen3 checkpoints and minigpt runs (safetensors, "
    "no pickle).",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(convert_app, name="convert")


def _overwrite(help: str) -> tuple[Option, ...]:
    """The shared --overwrite, with what it replaces for this command."""
    return tuple(o.with_help(help) for o in options_of(OverwriteConfig))


def _overwriting(given: Given) -> bool:
    """Whether --overwrite was given."""
    return OverwriteConfig(**given.of(OverwriteConfig)).overwrite


def _report_conversion(result: Any, what: str) -> None:
    from minigpt.cli.views import conversion_summary

    typer.echo(conversion_summary(result, what), err=True)
    if result.note:
        typer.echo(f"note: {result.note}", err=True)


@convert_app.command("from-hf")
@with_options(options_of(ImportConfig), _overwrite("Replace an existing run at OUT."))
def convert_from_hf(
    src: Annotated[
        Path,
        typer.Argument(
            help="Local Hugging Face GPT-2, Llama or Qwen3 directory (config.json + model.safetensors)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="minigpt run directory to write.")],
    given: Given = NO_OPTIONS,
) -> None:
    """Import a Hugging Face GPT-2, Llama or Qwen3 model as a minigpt run, offline.

    GPT-2 weights (gpt2 ... gpt2-xl, or any GPT-2 shape), or a Llama or Qwen3 model with plain rotary
    positions.

    Example: `minigpt convert from-hf ./gpt2 checkpoints/gpt2`, then `minigpt params checkpoints/gpt2`
    or `minigpt train input.txt --init-from checkpoints/gpt2`.
    """
    from minigpt.convert.hf import from_hf
    from minigpt.corpus.progress import Progress

    settings = ImportConfig(**given.of(ImportConfig))
    result = from_hf(src, out, settings, overwrite=_overwriting(given), progress=Progress(True))
    _report_conversion(result, "minigpt run")


_ExportedRun = Annotated[
    Path, typer.Argument(help="Run directory written by `minigpt train` or `convert from-hf`.")
]


@convert_app.command("to-hf")
@with_options(_overwrite("Write into a non-empty OUT, replacing its model files."))
def convert_to_hf(
    run: _ExportedRun,
    out: Annotated[Path, typer.Argument(help="Directory to write for transformers' from_pretrained.")],
    given: Given = NO_OPTIONS,
) -> None:
    """Export a run for transformers' AutoModelForCausalLM.from_pretrained(OUT).

    GPT-2 architecture as GPT2LMHeadModel; rotary + RMSNorm + SwiGLU (any --n-kv-head) as LlamaForCausalLM,
    with --qk-norm (and windows) as Qwen3ForCausalLM. An option none of them holds is an error naming it.

    The tokenizer (any kind: bpe, char, tiktoken) is written as tokenizer.json for AutoTokenizer, GPT-2
    style ones also as vocab.json + merges.txt; a model card describes the model.
    """
    from minigpt.convert.hf import to_hf
    from minigpt.convert.hf_map import ARCHITECTURES, family_for
    from minigpt.corpus.progress import Progress

    result = to_hf(run, out, overwrite=_overwriting(given), progress=Progress(True))
    _report_conversion(result, ARCHITECTURES[family_for(result.config)])


@convert_app.command("to-gguf")
@with_options(_overwrite("Replace an existing OUT file."), options_of(GGUFConfig))
def convert_to_gguf(
    run: _ExportedRun,
    out: Annotated[Path, typer.Argument(help="The GGUF file to write (e.g. model.gguf).")],
    given: Given = NO_OPTIONS,
) -> None:
    """Export a run as one GGUF file for llama.cpp, the tokenizer included (needs the gguf extra).

    GPT-2 architecture as llama.cpp's gpt2; rotary + RMSNorm + SwiGLU as llama, with --qk-norm as qwen3. An
    option llama.cpp cannot run is an error naming it.

    Example: `minigpt convert to-gguf checkpoints/input input.gguf`, then
    `llama-completion -m input.gguf -p "ROMEO:" -n 50 --temp 0`.
    """
    from minigpt.convert.to_gguf import gguf_architecture, to_gguf
    from minigpt.corpus.progress import Progress

    settings = GGUFConfig(**given.of(GGUFConfig))
    result = to_gguf(run, out, settings, overwrite=_overwriting(given), progress=Progress(True))
    _report_conversion(result, f"GGUF ({gguf_architecture(result.config)}, {settings.dtype})")


@convert_app.command("merge")
@with_options(options_of(MergeConfig), _overwrite("Replace an existing run at --out."))
def convert_merge(
    run: Annotated[Path, typer.Argument(help="A LoRA run (trained with --lora-rank).")],
    given: Given = NO_OPTIONS,
) -> None:
    """Merge a LoRA run's adapter into its base's weights: a plain run, without the adapter's base.

    Example: `minigpt convert merge checkpoints/chat-lora --out checkpoints/chat`.
    """
    from minigpt.corpus.progress import Progress
    from minigpt.train.finetune import merge_run

    path = merge_run(run, MergeConfig(**given.of(MergeConfig)), _overwriting(given), Progress(True))
    typer.echo(f"wrote {path}: {run} merged into its base", err=True)


@app.command()
@with_options(options_of(GenerateConfig), options_of(EngineConfig), options_of(GenerateIOConfig))
def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(
            help="Text to continue; '-' reads it from standard input. Empty or omitted: start from "
            "<|endoftext|> where the tokenizer has it, else from a newline."
        ),
    ] = None,
    model: RunOption = None,
    given: Given = NO_OPTIONS,
    as_json: Annotated[
        bool, _json_option("one JSON object: text, token counts, tokens/s and finish reason per sample")
    ] = False,
) -> None:
    """Continue a prompt with a trained model: text on stdout, everything else on stderr.

    Examples: `minigpt generate "ROMEO:"`, `minigpt generate -n 500 -t 0.9 --top-p 0.95 --seed 1 "Once"`,
    `cat prompt.txt | minigpt generate - --stop $'\\n\\n' > out.txt` (in bash, $'...' makes \\n a newline).
    """
    import secrets

    _quiet_openmp()
    from minigpt.generate.decode import Generation, encode_prompt
    from minigpt.generate.load import check_samples_fit, generation_engine

    settings, run_on = GenerateConfig(**given.of(GenerateConfig)), EngineConfig(**given.of(EngineConfig))
    shown = GenerateIOConfig(**given.of(GenerateIOConfig))
    if as_json and shown.stream:
        raise MinigptError("--json prints one object at the end: drop --stream", exit_code=2)
    text = read_prompt(prompt, shown.prompt_file)
    model = _run_or_latest(model, _NAME_MODEL)
    started = time.perf_counter()
    engine, tokenizer = generation_engine(model, run_on, shown.explain)
    loaded = time.perf_counter() - started
    ids = encode_prompt(tokenizer, text)
    if len(ids) > engine.block_size:
        typer.echo(
            f"warning: the prompt is {len(ids):,} tokens, longer than the model's context of "
            f"{engine.block_size}: keeping its last {engine.block_size}",
            err=True,
        )
    reached = min(len(ids), engine.block_size) + settings.max_new_tokens
    check_samples_fit(model, engine, settings.num_samples, reached)
    gen = Generation(engine, tokenizer, ids, **settings.generation(secrets.randbits(31)))
    _write_generation(gen, model, as_json, shown.stream)
    if shown.explain:  # choose_backend sends --explain to torch
        import shutil

        from minigpt.analysis.attention_views import explain_lines

        for line in explain_lines(
            engine.model, tokenizer, ids, gen.samples, shutil.get_terminal_size().columns
        ):
            typer.echo(line, err=True)
    typer.echo(gen.summary(loaded), err=True)


def _launch(given: Given) -> LaunchConfig:
    """The launch options, refusing --nproc inside a torchrun launch."""
    import os

    launch = LaunchConfig(**given.of(LaunchConfig))
    if launch.processes > 1 and "WORLD_SIZE" in os.environ:
        raise MinigptError("--nproc starts torchrun itself; drop it under torchrun", exit_code=2)
    return launch


def _quiet_openmp() -> None:
    """Before torch loads OpenMP: its threads sleep soon after a parallel region instead of spinning on
    the cores the next step needs; the environment's setting stands."""
    import os

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _run_or_latest(run: Path | None, name_one: str) -> Path:
    """The run named, else the newest under checkpoints/ (said on stderr); `name_one`: how the command
    takes a run, for the error when there is none."""
    if run is not None:
        return run
    from minigpt.runs.folder import RunDir

    latest = RunDir.latest(name_one=name_one).path
    typer.echo(f"using {latest}", err=True)
    return latest


@contextlib.contextmanager
def _writing_stdout() -> Iterator[None]:
    """Ctrl-C ends the command with 130; a reader that has gone (say `| head`) ends it quietly with 0."""
    import os

    try:
        yield
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # keep Python from complaining about the closed pipe at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None


def _write_generation(gen: Any, model: Path, as_json: bool, stream: bool | None) -> None:
    """The samples on stdout: streamed text, or one JSON object at the end."""
    from minigpt.generate.decode import write_text

    with _writing_stdout():
        if as_json:
            from minigpt.cli.views import print_json  # rich: start-up time that plain text does not need

            gen.run()
            print_json({"model": str(model), **gen.to_json()})
            return
        write_text(gen, sys.stdout, stream=sys.stdout.isatty() if stream is None else stream)


@app.command()
@with_options(
    options_of(ChatConfig),
    options_of(GenerateConfig, skip=("num_samples", "slide")),
    options_of(EngineConfig),
)
def chat(
    run: Annotated[
        Path | None,
        typer.Argument(
            help="Run directory fine-tuned on conversations (default: the newest under checkpoints/)."
        ),
    ] = None,
    given: Given = NO_OPTIONS,
    as_json: Annotated[
        bool, _json_option("one JSON object per answer of piped input (answer, finish_reason)")
    ] = False,
) -> None:
    """Chat with a run fine-tuned on conversations: answers stream as they are generated.

    On a terminal: type a message, Enter sends it; Ctrl-C stops an answer, Ctrl-D ends the chat; /reset,
    /save FILE, /help. Piped: each line of standard input is a conversation (a JSON record as in the
    training data, or a line of text as the user's message), answered on one line of its own.
    """
    import secrets

    _quiet_openmp()
    from minigpt.chat.session import ChatSession
    from minigpt.chat.terminal import interactive, piped
    from minigpt.generate.load import generation_engine

    settings, run_on = GenerateConfig(**given.of(GenerateConfig)), EngineConfig(**given.of(EngineConfig))
    system = ChatConfig(**given.of(ChatConfig)).system
    run = _run_or_latest(run, _NAME_RUN.format("chat"))
    seed = settings.seed
    if seed is None and settings.temperature > 0:
        seed = secrets.randbits(31)
        typer.echo(f"seed {seed}", err=True)
    engine, tokenizer = generation_engine(run, run_on)
    session = ChatSession(engine, tokenizer, settings, system, seed=seed or 0)
    with _writing_stdout():
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())

            interactive(session, input, sys.stdout, sys.stderr)
        else:
            piped(session, sys.stdin.buffer, sys.stdout, system, as_json)


@app.command()
@with_options(options_of(DemoConfig), _overwrite("Replace an existing run at --out."))
def demo(given: Given = NO_OPTIONS) -> None:
    """Train on Python's own documentation (no file needed), generate from the model, count its parameters.

    The same three steps as `minigpt train FILE`, `minigpt generate` and `minigpt params RUN`.
    """
    from minigpt.cli.demo import DEMO_PROMPT, generate_demo_text, show_demo_params, train_demo
    from minigpt.cli.training_display import TrainingDisplay

    cfg = DemoConfig(**given.of(DemoConfig))
    result = train_demo(cfg, TrainingDisplay(), _overwriting(given))
    if result.interrupted:
        raise typer.Exit(130)
    typer.echo(
        f"\n== 2/3 generating {cfg.tokens} tokens from {cfg.out} after the prompt {DEMO_PROMPT!r}", err=True
    )
    generate_demo_text(cfg, sys.stdout)
    typer.echo(f"\n== 3/3 parameters of {cfg.out}", err=True)
    show_demo_params(cfg.out)


def main() -> None:
    startup.pause()  # the collector is off until the command starts (minigpt.common.startup)
    try:
        app(obj={"started": process_started()})
    finally:
        startup.exiting()


@app.command()
@with_options(options_of(ServeConfig), options_of(EngineConfig, skip=("quantize",)))
def serve(
    run: Annotated[
        Path | None, typer.Argument(help="Run directory to serve (default: the newest under checkpoints/).")
    ] = None,
    given: Given = NO_OPTIONS,
) -> None:
    """Serve runs over an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) and a web page.

    Example: `minigpt serve`, then
    `curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:"}'`.
    Several runs: `minigpt serve checkpoints/a --model checkpoints/b`; a request names one (its folder):
    `curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "b", "prompt": "ROMEO:"}'`.
    """
    _quiet_openmp()
    from minigpt.serve.server import require_extra, run_server

    require_extra()  # before the models load
    from minigpt.serve.models import load_models

    cfg, run_on = ServeConfig(**given.of(ServeConfig)), EngineConfig(**given.of(EngineConfig))
    paths = ([run] if run is not None else []) + list(cfg.models or [])
    paths = paths or [_run_or_latest(None, _NAME_RUN.format("serve"))]
    run_server(load_models(paths, run_on, cfg), cfg)
