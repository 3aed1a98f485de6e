"""What the commands print: the params tables, the eval table, the runs table and one-line summaries (rich,
no logic). Tables fit the terminal they print on, wrapping a cell rather than cutting it; printed to a pipe
or a file they take the width that keeps every cell whole (`show`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from minigpt.common.files import to_json
from minigpt.model.params import ParamReport, Row
from minigpt.runs.folder import RunDir

if TYPE_CHECKING:
    from minigpt.analysis.evaluate import EvalResult
    from minigpt.convert.config import ConvertResult
    from minigpt.feedback.task_eval import TaskScore
    from minigpt.model.config import GPTConfig
    from minigpt.runs.summary import RunSummary


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


UNBOUNDED = 1 << 20  # columns: a width no line reaches


def natural_width(renderable: RenderableType) -> int:
    """The width `renderable` takes when no cell or line is wrapped."""
    console = Console(width=UNBOUNDED)
    return Measurement.get(console, console.options, renderable).maximum


def show(renderable: RenderableType, console: Console | None = None) -> None:
    """Print on stdout: on a terminal at its width; to a pipe or a file (whose width rich would take to be
    80 columns) at the width that keeps every cell and line whole, for grep and for reading."""
    console = console or Console()
    if not console.is_terminal:
        console.width = max(1, natural_width(renderable))
    console.print(renderable)


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left")


def _column(table: Table, name: str, justify: str = "left", **style: Any) -> None:
    """A column that wraps (folds) a value too wide for the terminal rather than cutting it to "…"."""
    table.add_column(name, justify=justify, overflow="fold", **style)  # type: ignore[arg-type]


def _rows_table(
    title: str, first: str, rows: list[Row], total_name: str, total: int, signed: bool = False
) -> Table:
    table = _table(title)
    _column(table, first)
    _column(table, "Formula", style="dim")
    _column(table, "Parameters", "right", no_wrap=True)
    for row in rows:
        table.add_row(row.name, row.formula, f"{row.count:+,}" if signed else f"{row.count:,}")
    table.add_section()
    table.add_row(Text(total_name, style="bold"), "", Text(f"{total:,}", style="bold"))
    return table


def _windows(c: GPTConfig) -> str:
    """The local layers' window, if any layer has one (the last layer is always full)."""
    local = c.n_layer * c.block_size - c.cached_positions
    if not local:
        return ""
    return f" window={c.window} ({c.window_pattern}, {local // (c.block_size - c.window)} local layers)"


def _speedrun(c: GPTConfig) -> str:
    """The speedrun options a model has on, for the caption (nothing when it has none)."""
    on = [f"{name}=True" for name, value in (("value_embeds", c.value_embeds), ("skips", c.skips)) if value]
    on += [f"logit_cap={c.logit_cap:g}"] if c.logit_cap is not None else []
    return "".join(f" {o}" for o in on)


def params_view(
    report: ParamReport, title: str, stored_total: int | None = None, optimizer: str | None = None
) -> Group:
    """The GPT-3 style table, the reconciliation with the module, and derived costs: the memory training
    takes with `optimizer` (a run's), or with each of them for a shape that was not trained."""
    c = report.config
    shape = (
        f"n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} head_dim={c.head_dim} "
        f"d_ff={c.d_ff} vocab_size={c.vocab_size:,} block_size={c.block_size:,} "
        f"bias={c.bias} tied={c.tie_embeddings}\npos={c.pos} norm={c.norm} mlp={c.mlp} qk_norm={c.qk_norm} "
        f"n_kv_head={c.kv_heads}{_windows(c)} attn_score={c.attn_score}{_speedrun(c)}"
    )
    table = _rows_table(
        f"Parameters of {title}", "Part", report.rows, "Total (GPT-3 style)", report.gpt3_total
    )
    table.caption = shape
    recon = _rows_table(
        "Reconciliation with the module minigpt builds", "Adjustment", report.adjustments, "Exact total",
        report.exact_total, signed=True,
    )  # fmt: skip
    if stored_total is not None:
        ok = stored_total == report.exact_total
        mark = Text("✓ matches" if ok else "✗ differs", style="green" if ok else "bold red")
        recon.add_row(f"Stored in {RunDir.WEIGHTS}", mark, f"{stored_total:,}")

    costs = _table("Where they are and what they cost")
    _column(costs, "Quantity")
    _column(costs, "Value", "right")
    for part, n in report.shares.items():
        costs.add_row(f"share: {part}", f"{n:,} ({100 * n / report.exact_total:.1f}%)")
    m = report.memory_bytes
    costs.add_row(
        "weights fp32 / bf16", f"{human_bytes(m['weights_fp32'])} / {human_bytes(m['weights_bf16'])}"
    )
    if optimizer in (None, "adamw"):
        costs.add_row("training with AdamW (16 B/param)", human_bytes(m["training_adamw"]))
    if optimizer in (None, "muon"):
        costs.add_row("training with Muon + AdamW (12 B/param in blocks)", human_bytes(m["training_muon"]))
    f = report.flops_per_token
    costs.add_row(
        "FLOPs per token: forward / training", f"{human_count(f['forward'])} / {human_count(f['training'])}"
    )
    kv = report.kv_cache_bytes
    costs.add_row(
        "KV cache per token bf16 / fp32",
        f"{human_bytes(kv['per_token_bf16'])} / {human_bytes(kv['per_token_fp32'])}",
    )
    costs.add_row(
        f"KV cache, full context of {c.block_size:,} bf16 / fp32",
        f"{human_bytes(kv['full_context_bf16'])} / {human_bytes(kv['full_context_fp32'])}",
    )
    notes = Text("\n".join(f"{k}: {v}" for k, v in report.formulas.items()), style="dim")
    return Group(table, Text(""), recon, Text(""), costs, notes)


def print_params(
    report: ParamReport,
    title: str,
    stored_total: int | None = None,
    trained: str | None = None,
    console: Console | None = None,
    optimizer: str | None = None,
) -> None:
    view = params_view(report, title, stored_total, optimizer)
    show(Group(view, Text(trained, style="dim")) if trained else view, console)


def trained_with(run: RunDir) -> str | None:
    """The optimizer a run was trained with (None: not trained by minigpt, e.g. converted)."""
    train = run.read_config().get("train")
    # runs saved before the optimizer was a setting trained with AdamW
    return str(train.get("optimizer", "adamw")) if isinstance(train, dict) else None


def print_json(obj: Any) -> None:
    """One indented JSON object on stdout, strict JSON (a NaN or infinite value is written as null)."""
    sys.stdout.write(to_json(obj, indent=2) + "\n")


def eval_view(result: EvalResult, title: str) -> Table:
    table = _table(title)
    for name in ("loss (nats/token)", "perplexity", "bits per byte", "tokens", "bytes"):
        _column(table, name, "right")
    table.add_row(
        f"{result.loss:.4f}",
        f"{result.perplexity:.2f}",
        f"{result.bits_per_byte:.4f}",
        f"{result.tokens:,}",
        f"{result.bytes:,}",
    )
    return table


def task_eval_view(score: TaskScore, title: str) -> Table:
    table = _table(title)
    columns = ["tasks", "reward", "greedy (mean reward)"] + (
        [f"pass@{score.samples}"] if score.pass_at_k is not None else []
    )
    for name in columns:
        _column(table, name, "right")
    cells = [f"{score.tasks:,}", score.reward, f"{score.greedy:.4f}"]
    table.add_row(*cells, *([f"{score.pass_at_k:.4f}"] if score.pass_at_k is not None else []))
    return table


def conversion_summary(result: ConvertResult, what: str) -> str:
    c = result.config
    return (
        f"wrote {result.out}: {what}, {result.params:,} parameters "
        f"({c.n_layer} layers, {c.n_head} heads, width {c.n_embd}), tokenizer {result.tokenizer}"
    )


def human_duration(seconds: float) -> str:
    """2:05, 1:02:03, or 3d 4h for long spans."""
    s = int(round(seconds))
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600}h"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _maybe(value: float | int | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


# the runs table's columns as shown, and which go first when the terminal is narrow: the run's path stays,
# then what tells runs apart (loss, age, data, size), then the rest
_RUN_COLUMNS = ("run", "data", "tokenizer", "shape", "arch", "params", "steps", "tokens", "best val", "bpb",
                "time", "age", "exported")  # fmt: skip
_DROPPED_FIRST = ("exported", "arch", "tokens", "time", "shape", "tokenizer", "steps", "bpb", "params",
                  "data", "age", "best val")  # fmt: skip
_NUMBERS = {"params", "steps", "tokens", "best val", "bpb", "time", "age"}


def _run_cells(s: RunSummary) -> dict[str, str]:
    return {
        "run": s.path, "data": s.data, "tokenizer": s.tokenizer, "shape": s.shape, "arch": s.arch,
        "params": human_count(s.params), "steps": _maybe(s.steps, ","),
        "tokens": "—" if s.tokens is None else human_count(s.tokens), "best val": _maybe(s.best_val_loss, ".4f"),
        "bpb": _maybe(s.best_val_bpb, ".3f"), "time": "—" if s.elapsed is None else human_duration(s.elapsed),
        "age": human_duration(s.age) + " ago", "exported": ", ".join(s.exports) or "—",
    }  # fmt: skip


def _runs_table(title: str, columns: list[str], rows: list[dict[str, str]], left_out: list[str]) -> Table:
    table = _table(title)
    for name in columns:
        _column(table, name, "right" if name in _NUMBERS else "left", no_wrap=name in _NUMBERS)
    for cells in rows:
        table.add_row(*(cells[name] for name in columns))
    if left_out:
        table.caption = f"left out at this width: {', '.join(left_out)} (--json has every field)"
        table.caption_justify = "left"
    return table


def runs_view(summaries: list[RunSummary], title: str, width: int | None = None) -> Table:
    """One line per run, newest first; an "exported" column when some run was exported (to hf, gguf).
    At `width` (a terminal's), columns go in _DROPPED_FIRST's order until the table fits; the path stays
    whole, folded onto more lines only where it alone is too wide."""
    rows = [_run_cells(s) for s in summaries]
    shown = [c for c in _RUN_COLUMNS if c != "exported" or any(s.exports for s in summaries)]
    left_out: list[str] = []
    table = _runs_table(title, shown, rows, left_out)
    for name in _DROPPED_FIRST:
        if width is None or natural_width(table) <= width:
            break
        if name in shown:
            shown.remove(name)
            left_out = [c for c in _RUN_COLUMNS if c not in shown and c in left_out + [name]]
            table = _runs_table(title, shown, rows, left_out)
    return table


def training_summary(s: RunSummary) -> str:
    """How a run was trained, in two lines under its params tables."""
    if s.steps is None:
        return f"{s.data}; tokenizer {s.tokenizer}"
    best = "—" if s.best_val_loss is None else f"{s.best_val_loss:.4f} (bpb {_maybe(s.best_val_bpb, '.3f')})"
    spent = "—" if s.elapsed is None else human_duration(s.elapsed)
    return (
        f"trained on {s.data}, tokenizer {s.tokenizer}: {s.steps:,} steps, "
        f"{_maybe(s.tokens, ',')} tokens in {spent}; best val loss {best}\n{s.settings}"
    )
