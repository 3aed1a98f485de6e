"""What the commands print: the params tables, the eval table and one-line summaries (rich, no logic)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from minigpt.common.files import to_json
from minigpt.model.params import ParamReport, Row
from minigpt.runs.folder import RunDir

if TYPE_CHECKING:
    from minigpt.analysis.evaluate import EvalResult
    from minigpt.convert.config import ConvertResult
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


def _rows_table(
    title: str, first: str, rows: list[Row], total_name: str, total: int, signed: bool = False
) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(first)
    table.add_column("Formula", style="dim")
    table.add_column("Parameters", justify="right")
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


def params_view(report: ParamReport, title: str, stored_total: int | None = None) -> Group:
    """The GPT-3 style table, the reconciliation with the module, and derived costs."""
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

    costs = Table(title="Where they are and what they cost", title_justify="left")
    costs.add_column("Quantity")
    costs.add_column("Value", justify="right")
    for part, n in report.shares.items():
        costs.add_row(f"share: {part}", f"{n:,} ({100 * n / report.exact_total:.1f}%)")
    m = report.memory_bytes
    costs.add_row(
        "weights fp32 / bf16", f"{human_bytes(m['weights_fp32'])} / {human_bytes(m['weights_bf16'])}"
    )
    costs.add_row("training with AdamW (16 B/param)", human_bytes(m["training_adamw"]))
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
) -> None:
    console = console or Console()
    console.print(params_view(report, title, stored_total))
    if trained:
        console.print(Text(trained, style="dim"))


def print_json(obj: Any) -> None:
    """One indented JSON object on stdout, strict JSON (a NaN or infinite value is written as null)."""
    sys.stdout.write(to_json(obj, indent=2) + "\n")


def eval_view(result: EvalResult, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in ("loss (nats/token)", "perplexity", "bits per byte", "tokens", "bytes"):
        table.add_column(name, justify="right")
    table.add_row(
        f"{result.loss:.4f}",
        f"{result.perplexity:.2f}",
        f"{result.bits_per_byte:.4f}",
        f"{result.tokens:,}",
        f"{result.bytes:,}",
    )
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


def runs_view(summaries: list[RunSummary], title: str) -> Table:
    """One line per run, newest first; an "exported" column when some run was exported (to hf, gguf)."""
    exported = any(s.exports for s in summaries)
    table = Table(title=title, title_justify="left")
    for name, justify in (("run", "left"), ("data", "left"), ("tokenizer", "left"), ("shape", "left"),
                          ("arch", "left"), ("params", "right"), ("steps", "right"), ("tokens", "right"), ("best val", "right"),
                          ("bpb", "right"), ("time", "right"), ("age", "right")):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    if exported:
        table.add_column("exported")
    for s in summaries:
        table.add_row(
            s.path, s.data, s.tokenizer, s.shape, s.arch, human_count(s.params), _maybe(s.steps, ","),
            "—" if s.tokens is None else human_count(s.tokens), _maybe(s.best_val_loss, ".4f"),
            _maybe(s.best_val_bpb, ".3f"), "—" if s.elapsed is None else human_duration(s.elapsed),
            human_duration(s.age) + " ago", *([", ".join(s.exports) or "—"] if exported else []),
        )  # fmt: skip
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
