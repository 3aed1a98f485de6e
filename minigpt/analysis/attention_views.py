"""Attention drawn for people: tables and grids in the terminal, a heatmap PNG, the lines of `generate
--explain` (what `minigpt.analysis.attention` computes)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.analysis.attention import (
    HeadFocus,
    Inspection,
    attention_maps,
    explain_last,
    inspect_text,
    token_label,
    top_attended,
)
from minigpt.analysis.attention_config import AttentionConfig
from minigpt.errors import MinigptError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from rich.console import RenderableType

    from minigpt.model.gpt import GPT
    from minigpt.tokenizer.base import Tokenizer

# the terminal views draw at most this many tokens: wider grids stop being readable
DISPLAY_TOKENS = 64


def format_explain(focus: Sequence[HeadFocus], width: int | None = None, indent: int = 0) -> str:
    """Lines such as `L1 h0: ⏎@12 61% e@3 20% │ h1: ...`: position and weight of each head's top tokens,
    broken between heads (never inside one) so that, after `indent` columns, each fits in `width`."""
    from rich.cells import cell_len

    parts = []
    for i, f in enumerate(focus):
        tokens = " ".join(f"{a.label}@{a.position} {a.weight:.0%}" for a in f.top)
        parts.append(f"{f'L{f.layer} ' if i == 0 else ''}h{f.head}: {tokens}")
    lines = [""]
    for part in parts:
        joined = f"{lines[-1]} │ {part}" if lines[-1] else part
        if width is None or indent + cell_len(joined) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append(part)
    return ("\n" + " " * indent).join(lines)


def explain_lines(
    model: GPT, tokenizer: Tokenizer, prompt_ids: list[int], samples: Sequence[Any], width: int
) -> list[str]:
    """For every generated token of every sample, the earlier tokens each last-layer head attended to most:
    what `generate --explain` prints."""
    lines = []
    for n, sample in enumerate(samples):
        if len(samples) > 1:
            lines.append(f"sample {n + 1}:")
        context = list(prompt_ids)
        for token in sample.token_ids:
            focus = explain_last(model, context, tokenizer, top=3)
            lines.append(
                f"{token_label(tokenizer.decode_bytes([token])):>8} ← {format_explain(focus, width, 11)}"
            )
            context.append(token)
    return lines


def inspection_views(seen: Inspection, model: str, width: int, top: int) -> list[RenderableType]:
    """What `minigpt attention` prints for an inspection: one table of every layer's and head's row, or
    one grid per head of a layer."""
    if seen.layer is None:
        title = (
            f"Attention from position {seen.position} ({seen.labels[seen.position]}) over positions "
            f"0..{seen.position}, in %: {seen.n_layer} layers × {seen.n_head} heads of {model}"
        )
        return [position_view(seen.weights, seen.labels, title, width, top=top, windows=seen.windows)]
    window = seen.windows[seen.layer]
    note = f"; each position sees the last {window} (its window)" if window <= seen.position else ""
    return [
        grid_view(seen.weights[h], seen.labels,
                  f"Layer {seen.layer}, head {h} of {model}: row = position, column = the position it "
                  f"attends to{note}", width, window=window)
        for h in seen.heads
    ]  # fmt: skip


def show_attention(run: Path, text: str, cfg: AttentionConfig, as_json: bool) -> None:
    """`minigpt attention`: what run's heads weight over `text`, as views on stdout (or one JSON line), a
    PNG with cfg.png; notes on stderr."""
    import json

    from minigpt.generate.load import load_engine

    engine, tokenizer = load_engine(run, "torch", "cpu", "float32")
    seen = inspect_text(engine.model, tokenizer, text, cfg)
    if seen.dropped:
        print(
            f"note: the text is {len(seen.ids) + seen.dropped} tokens, more than the model's block_size "
            f"{engine.block_size}: keeping the last {engine.block_size}",
            file=sys.stderr,
        )
    if as_json:
        # one compact line: T x T weights indented one number per line would run to millions of lines
        sys.stdout.write(json.dumps(seen.to_json(str(run)), separators=(",", ":")) + "\n")
    else:
        print_inspection(seen, str(run), cfg.top)
    if cfg.png is not None:
        write_inspection_png(cfg.png, engine.model, seen)
        print(f"wrote {cfg.png}", file=sys.stderr)


def print_inspection(seen: Inspection, model: str, top: int) -> None:
    """`minigpt attention`'s views on stdout, with a note on stderr when some positions are left out."""
    from rich.console import Console

    if len(seen.ids) > DISPLAY_TOKENS:
        print(
            f"note: showing the last {DISPLAY_TOKENS} of {len(seen.ids)} positions (--json has them all)",
            file=sys.stderr,
        )
    console = Console()
    for view in inspection_views(seen, model, console.width, top):
        console.print(view)


def write_inspection_png(path: Path, model: GPT, seen: Inspection) -> None:
    """The full grids of the inspected layer (every layer without one) and heads, tiled into a PNG."""
    maps = attention_maps(model, seen.ids).weights
    layers = range(seen.n_layer) if seen.layer is None else [seen.layer]
    write_png(path, [(f"layer {a} head {h}", maps[a, h]) for a in layers for h in seen.heads], seen.labels)


# --------------------------------------------------------------------------- terminal views

# a dark-to-bright ramp (inferno-like): readable on dark and light terminals, and rich downsamples it
_RAMP = [(0, 0, 4), (87, 16, 110), (188, 55, 84), (249, 142, 9), (252, 255, 164)]
_SHADES = "·░▒▓█"


def _ramp(w: float) -> tuple[int, int, int]:
    t = min(1.0, max(0.0, w)) ** 0.5  # a square root spreads out the small weights most heads produce
    x = t * (len(_RAMP) - 1)
    i = min(int(x), len(_RAMP) - 2)
    f = x - i
    a, b = _RAMP[i], _RAMP[i + 1]
    return (round(a[0] + (b[0] - a[0]) * f), round(a[1] + (b[1] - a[1]) * f), round(a[2] + (b[2] - a[2]) * f))


def _cell_style(w: float, strong: bool) -> str:
    if round(100 * w) == 0:
        return ""  # unshaded, like the blank text: only weights that show as a number get a colour
    r, g, b = _ramp(w)
    fg = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 128 else "white"
    return f"{'bold ' if strong else ''}{fg} on rgb({r},{g},{b})"


def _shade(w: float) -> str:
    """A glyph whose darkness follows the weight, so the grid still reads without colour."""
    for glyph, limit in zip(_SHADES, (0.05, 0.2, 0.4, 0.7), strict=False):
        if w < limit:
            return glyph
    return _SHADES[-1]


def _fit(label: str, width: int) -> str:
    from rich.cells import cell_len, set_cell_size

    return label if cell_len(label) <= width else set_cell_size(label, width - 1) + "…"


def _percent(w: float) -> str:
    p = round(100 * w)
    return "" if p == 0 else str(p)  # blank, not 0: the few strong weights stand out even without colour


def position_view(
    weights: torch.Tensor,
    labels: Sequence[str],
    title: str,
    width: int,
    top: int = 3,
    display: int = DISPLAY_TOKENS,
    windows: Sequence[int] | None = None,
) -> RenderableType:
    """Every layer's and head's weights from one position over positions 0..position, as percentages.

    weights: (L, H, position+1). Columns are the last `display` tokens, split into tables that fit `width`;
    a row's `top` strongest cells are bold; a summary lists each head's top tokens over all positions.
    `windows`: how many of the latest positions each layer sees; those before are shown as "-".
    """
    from rich.console import Group
    from rich.text import Text

    L, H, n = weights.shape
    start = max(0, n - display)
    row_names = [f"L{layer} H{head}" for layer in range(L) for head in range(H)]
    rows = weights.reshape(L * H, n)
    col_w = [max(3, min(6, _cell_width(labels[p]))) for p in range(n)]
    shown = _ShownPositions(
        rows, row_names, labels, col_w, start, H,
        strong=[{p for p, _ in top_attended(r, top)} for r in rows],
        first_seen=[max(0, n - w) for w in windows] if windows is not None else [0] * L,
    )  # fmt: skip
    parts = _position_notes(title, n, start, windows)
    for c, chunk in enumerate(_column_chunks(col_w, start, max(len(s) for s in row_names), width)):
        parts.extend([Text(""), _position_table(shown, chunk, with_earlier=bool(start) and c == 0)])
    parts.extend([Text(""), Text(f"Top {top} attended tokens per head", style="bold")])
    parts.append(_top_summary(rows, row_names, labels, top, H))
    return Group(*parts)


@dataclass
class _ShownPositions:
    """What `position_view`'s tables draw: one row of weights per (layer, head) over the positions, their
    names and column labels and widths, where the shown columns start, heads per layer, each row's
    strongest positions, and each layer's first position inside its window."""

    rows: torch.Tensor
    row_names: list[str]
    labels: Sequence[str]
    col_w: list[int]
    start: int
    heads: int
    strong: list[set[int]]
    first_seen: list[int]


def _position_notes(title: str, n: int, start: int, windows: Sequence[int] | None) -> list[RenderableType]:
    """The title, then what a reader must know to read the tables: which layers see only their window,
    and that the first column sums the positions not shown."""
    from rich.text import Text

    parts: list[RenderableType] = [Text(title, style="bold")]
    local = [layer for layer, w in enumerate(windows or []) if w < n]
    if windows is not None and local:
        who = ("layer {} sees only its" if len(local) == 1 else "layers {} see only their").format(
            ", ".join(map(str, local))
        )
        note = f"({who} window, the last {windows[local[0]]} tokens: - before it)"
        parts.append(Text(note, style="dim"))
    if start:
        parts.append(
            Text(f"(earlier: the total weight on the {start} tokens before those shown)", style="dim")
        )
    return parts


def _column_chunks(col_w: Sequence[int], start: int, name_w: int, width: int) -> list[list[int]]:
    """The shown positions split into tables that fit `width` (one space between columns; the first
    table also holds the "earlier" column when positions are left out)."""
    chunks: list[list[int]] = [[]]
    used = name_w + (7 if start else 0)
    for p in range(start, len(col_w)):
        if chunks[-1] and used + col_w[p] + 1 > width:
            chunks.append([])
            used = name_w
        chunks[-1].append(p)
        used += col_w[p] + 1
    return chunks


def _position_table(shown: _ShownPositions, chunk: Sequence[int], with_earlier: bool) -> RenderableType:
    """One table of `position_view`: every head's weights on the positions of `chunk` as percentages
    (the strongest bold, those before a layer's window "-"), led by the "earlier" column where asked."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, pad_edge=False)
    table.add_column("", no_wrap=True, style="bold")
    if with_earlier:
        table.add_column(Text("…\nearlier", justify="right"), justify="right", no_wrap=True)
    for p in chunk:
        header = Text(f"{p}\n{_fit(shown.labels[p], shown.col_w[p])}", justify="right")
        table.add_column(header, justify="right", no_wrap=True, min_width=shown.col_w[p])
    H, names = shown.heads, shown.row_names
    for i, name in enumerate(names):
        cells: list[Text] = []
        if with_earlier:
            rest = float(shown.rows[i, : shown.start].sum())
            cells.append(Text(_percent(rest), style=_cell_style(rest, False)))
        for p in chunk:
            w = float(shown.rows[i, p])
            if p < shown.first_seen[i // H]:
                cells.append(Text("-", style="dim"))
            else:
                cells.append(Text(_percent(w), style=_cell_style(w, p in shown.strong[i])))
        table.add_row(name, *cells, end_section=(i + 1) % H == 0 and i + 1 < len(names))
    return table


def _top_summary(
    rows: torch.Tensor, row_names: Sequence[str], labels: Sequence[str], top: int, H: int
) -> RenderableType:
    """Each head's `top` most attended tokens over all positions, with where they are and their weight."""
    from rich.table import Table
    from rich.text import Text

    summary = Table(box=None, padding=(0, 2, 0, 0))
    summary.add_column("head", style="bold", no_wrap=True)
    for k in range(min(top, rows.shape[1])):
        summary.add_column(f"#{k + 1}", no_wrap=True)
    for i, name in enumerate(row_names):
        cells = [
            Text.assemble((_fit(labels[p], 12), "bold"), f"@{p} {w:.0%}")
            for p, w in top_attended(rows[i], top)
        ]
        summary.add_row(name, *cells, end_section=(i + 1) % H == 0 and i + 1 < len(row_names))
    return summary


def _cell_width(label: str) -> int:
    from rich.cells import cell_len

    return cell_len(label)


def grid_view(
    weights: torch.Tensor,
    labels: Sequence[str],
    title: str,
    width: int,
    display: int = DISPLAY_TOKENS,
    window: int | None = None,
) -> RenderableType:
    """One head's T x T pattern as shaded cells: row = query position, column = attended position.

    The upper triangle (future tokens, masked) stays blank, and so does what lies before a local layer's
    `window` (drawn as "-"). Only the last `display` positions are drawn.
    Cells are two characters wide when that fits `width`, else one.
    """
    from rich.console import Group
    from rich.text import Text

    T = weights.size(0)
    start = max(0, T - display)
    shown = range(start, T)
    label_w = min(8, max(_cell_width(labels[p]) for p in shown))
    index_w = len(str(T - 1))
    prefix = index_w + 1 + label_w + 1
    cw = 2 if prefix + 2 * len(shown) <= width else 1
    lines: list[Text] = [Text(title, style="bold")]
    # column labels run downwards, one character per line, under a ruler of every tenth position
    lines.append(Text(" " * prefix + _ruler(shown, cw), style="dim"))
    columns = [_column_label(labels[p], cw) for p in shown]
    for r in range(max(len(c) for c in columns)):
        lines.append(
            Text(" " * prefix + "".join(c[r] if r < len(c) else " " * cw for c in columns), style="bold")
        )
    for q in shown:
        line = Text(f"{q:>{index_w}} ", style="dim")
        line.append(_pad(_fit(labels[q], label_w), label_w) + " ", style="bold")
        for p in shown:
            if p > q:
                line.append(" " * cw)
            elif window is not None and p <= q - window:
                line.append("-" * cw, style="dim")
            else:
                w = float(weights[q, p])
                r, g, b = _ramp(w)
                line.append(_shade(w) * cw, style=f"rgb({r},{g},{b})")
        lines.append(line)
    legend = "  ".join(f"{g} <{lim:.0%}" for g, lim in zip(_SHADES, (0.05, 0.2, 0.4, 0.7), strict=False))
    outside = ", -: before the window" if window is not None and window < T else ""
    lines.append(Text(f"{legend}  {_SHADES[-1]} ≥70%   (blank: future tokens, masked{outside})", style="dim"))
    return Group(*lines)


def _ruler(shown: range, cw: int) -> str:
    ruler = [" "] * (len(shown) * cw)
    for i, p in enumerate(shown):
        mark = str(p)
        if p % 10 == 0 and i * cw + len(mark) <= len(ruler):
            ruler[i * cw : i * cw + len(mark)] = mark
    return "".join(ruler)


def _pad(label: str, width: int) -> str:
    return label + " " * (width - _cell_width(label))


def _column_label(label: str, cw: int) -> list[str]:
    """A label cut into cells of width cw, top to bottom (at most 4 lines, the last one … if cut)."""
    from rich.cells import cell_len

    cells: list[str] = []
    current = ""
    for ch in label:
        if cell_len(current + ch) > cw:
            cells.append(current)
            current = ""
        if cell_len(ch) > cw:  # a wide character in a one-column grid: show a stand-in
            ch = "…"
        current += ch
    cells.append(current)
    if len(cells) > 4:
        cells = cells[:3] + ["…"]
    return [_pad(c, cw) for c in cells]


# --------------------------------------------------------------------------- PNG (optional: Pillow)


def _pillow():  # noqa: ANN202 (the module's type is only known once it is imported)
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise MinigptError("--png needs Pillow: pip install 'minigpt[viz]'") from None
    return Image, ImageDraw, ImageFont


def _png_font(size: int):  # noqa: ANN202
    """DejaVu Sans where the system has it (it draws ⏎ ⇥ and most scripts), else Pillow's own font."""
    _, _, ImageFont = _pillow()
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size), True
    except OSError:
        return ImageFont.load_default(size=size), False


def _ascii_label(label: str) -> str:
    # Pillow's built-in font draws ASCII only: keep the escapes readable without it
    swaps = {"⏎": "\\n", "⇥": "\\t", "·": "_", "␍": "\\r", "∅": "{}", "◌": ""}
    return "".join(swaps.get(ch, ch if ch.isascii() else f"\\u{ord(ch):04x}") for ch in label)


def _heat_rgb(weights: torch.Tensor) -> np.ndarray:
    """(T, T) weights to (T, T, 3) uint8 colours of the ramp, the masked upper triangle white."""
    import numpy as np

    w = weights.detach().float().cpu().numpy()
    ramp = np.array(_RAMP, dtype=np.float64)
    x = np.sqrt(np.clip(w, 0.0, 1.0)) * (len(_RAMP) - 1)
    i = np.minimum(x.astype(np.int64), len(_RAMP) - 2)
    f = (x - i)[..., None]
    rgb = ramp[i] + (ramp[i + 1] - ramp[i]) * f
    rgb[np.triu(np.ones(w.shape, dtype=bool), k=1)] = 255
    return np.rint(rgb).astype(np.uint8)


def write_png(path: Path, grids: Sequence[tuple[str, torch.Tensor]], labels: Sequence[str]) -> None:
    """Draw (title, T x T weights) grids as heatmaps into a PNG file, tiled when there are several.

    One grid gets its tokens along both axes (when its cells are big enough to label); each grid of a
    tile gets its title. Long texts and many heads shrink the cells, averaging them below a pixel, so
    the picture stays about 2000 pixels wide at most.
    """
    Image, ImageDraw, _ = _pillow()
    from minigpt.common.files import atomic_path

    path = Path(path)
    if not path.parent.is_dir():
        raise MinigptError(f"cannot write {path}: the directory {path.parent} does not exist")
    T = grids[0][1].size(0)
    n = len(grids)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    cell = min(18 if n == 1 else 8, 2000 // (T * cols))
    side = T * cell if cell >= 1 else max(16, 2000 // cols)
    with_labels = n == 1 and cell >= 8
    font, unicode_ok = _png_font(max(9, min(14, cell - 3)) if with_labels else 12)
    shown = labels if unicode_ok else [_ascii_label(s) for s in labels]
    pad, title_px = 10, 20
    label_px = max(int(font.getlength(s)) for s in shown) + 6 if with_labels else 0
    tile_w, tile_h = label_px + side + pad, title_px + label_px + side + pad
    img = Image.new("RGB", (pad + cols * tile_w, pad + rows * tile_h), "white")
    draw = ImageDraw.Draw(img)
    for g, (title, weights) in enumerate(grids):
        r, c = divmod(g, cols)
        x0, y0 = pad + c * tile_w + label_px, pad + r * tile_h + title_px + label_px
        draw.text((x0, y0 - label_px - title_px + 2), title, fill="black", font=font)
        heat = Image.fromarray(_heat_rgb(weights), mode="RGB")
        # nearest keeps crisp cells when enlarging; box averages them when there are more than pixels
        heat = heat.resize((side, side), Image.Resampling.NEAREST if cell >= 1 else Image.Resampling.BOX)
        img.paste(heat, (x0, y0))
        draw.rectangle((x0 - 1, y0 - 1, x0 + side, y0 + side), outline=(160, 160, 160))
        if with_labels:
            for i, s in enumerate(shown):
                # row labels right-aligned against the grid; column labels written upwards above it
                length = font.getlength(s)
                draw.text(
                    (x0 - 4 - length, y0 + i * cell + cell / 2), s, fill="black", font=font, anchor="lm"
                )
                patch = Image.new("RGBA", (int(length) + 2, cell), (255, 255, 255, 0))
                ImageDraw.Draw(patch).text((0, cell / 2), s, fill="black", font=font, anchor="lm")
                patch = patch.rotate(90, expand=True)
                img.paste(patch, (x0 + i * cell, y0 - 4 - patch.size[1]), patch)
    with atomic_path(path) as tmp:
        img.save(tmp, format="PNG")
