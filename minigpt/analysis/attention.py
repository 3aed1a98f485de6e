"""Attention patterns as the model's own attention computes them (`minigpt.analysis.attention_views` draws them)."""

from __future__ import annotations

import contextlib
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minigpt.analysis.attention_config import AttentionConfig
from minigpt.errors import UsageError

if TYPE_CHECKING:
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.tokenizer.base import Tokenizer

__all__ = [
    "Attended",
    "AttentionMaps",
    "HeadFocus",
    "attention_maps",
    "attention_row",
    "explain_last",
    "resolve_index",
    "token_label",
    "token_labels",
    "top_attended",
    "Inspection",
    "inspect_text",
]

_VISIBLE = {"\n": "⏎", "\t": "⇥", " ": "·", "\r": "␍"}
# characters that print as nothing, or as something mistakable for another character
_HIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"}


# --------------------------------------------------------------------------- labels


def token_label(data: bytes) -> str:
    """A one-line, unambiguous label for a token's bytes.

    Newline, tab, space and carriage return become ⏎ ⇥ · ␍; bytes that are not valid UTF-8 on their own
    (part of a multi-byte character) become \\xNN; other invisible characters become \\xNN or \\uNNNN; a
    literal backslash is doubled so the escapes stay unambiguous; a lone combining mark sits on ◌.
    """
    if not data:
        return "∅"
    text = data.replace(b"\\", b"\\\\").decode("utf-8", errors="backslashreplace")
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif unicodedata.category(ch) in _HIDDEN_CATEGORIES:
            # below 0x80 \xNN is the same byte; above, \uNNNN keeps \xNN meaning "a raw byte"
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x80 else f"\\u{ord(ch):04x}")
        elif unicodedata.category(ch).startswith("M") and not out:
            out.append("◌" + ch)
        else:
            out.append(ch)
    return "".join(out)


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Labels of each id decoded on its own (so a split multi-byte character shows as \\xNN pieces)."""
    return [token_label(tokenizer.decode_bytes([i])) for i in ids]


def resolve_index(value: int, size: int, what: str, plural: str) -> int:
    """Map value (negative counts from the end) into range(size), or raise a one-line UsageError."""
    if -size <= value < size:
        return value % size
    raise UsageError(
        f"{what} {value} is out of range: there are {size} {plural} (use 0..{size - 1} or -{size}..-1)"
    )


# --------------------------------------------------------------------------- computing the weights


@dataclass(frozen=True)
class AttentionMaps:
    """Every layer's and head's causal attention pattern over one sequence, and the logits it gives."""

    weights: torch.Tensor  # (n_layer, n_head, T, T) float32, rows sum to 1, zero above the diagonal
    logits: torch.Tensor  # (T, vocab_size), what the model's forward gives with all_logits=True


@contextlib.contextmanager
def _inference(model: GPT) -> Iterator[None]:
    """Eval mode (no dropout: inspection is inference) and no gradients, the model's mode restored after."""
    import torch

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)


def _probabilities(model: GPT, ids: Sequence[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each layer's (H, T, T) attention probabilities over ids, from GPT.forward itself, and the logits (T, V)."""
    import torch

    config = model.config
    if not ids:
        raise UsageError("there are no tokens to look at: give some text")
    if len(ids) > config.block_size:
        raise UsageError(f"{len(ids)} tokens is longer than the model's block_size {config.block_size}")
    idx = torch.tensor([list(ids)], dtype=torch.long, device=model.transformer.wte.weight.device)
    layers: list[torch.Tensor] = []
    with _inference(model):
        logits, _ = model(idx, all_logits=True, attention=layers)
    return [w[0] for w in layers], logits[0]


def attention_maps(model: GPT, ids: Sequence[int]) -> AttentionMaps:
    """All layers' and heads' full T x T patterns (memory grows as n_layer * n_head * T²)."""
    import torch

    layers, logits = _probabilities(model, ids)
    return AttentionMaps(weights=torch.stack(layers).cpu(), logits=logits.float().cpu())


def attention_row(model: GPT, ids: Sequence[int], position: int = -1) -> torch.Tensor:
    """The weights of one query position over positions 0..position, every layer and head: (L, H, position+1).

    Causality means later tokens cannot change it, so only ids[:position+1] are run.
    """
    import torch

    position = resolve_index(position, len(ids), "position", "tokens") if ids else 0
    layers, _ = _probabilities(model, ids[: position + 1])
    return torch.stack([w[:, -1, :] for w in layers]).cpu()


def top_attended(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k largest weights of a row as (position, weight), strongest first, earliest first on ties."""
    import torch

    k = min(k, row.numel())
    # a stable sort keeps ties in position order, so output does not depend on the topk kernel
    order = torch.sort(row, descending=True, stable=True).indices[:k]
    return [(int(i), float(row[i])) for i in order]


# --------------------------------------------------------------------------- `minigpt attention`


@dataclass(frozen=True)
class Inspection:
    """What `minigpt attention` shows for one text: one position's row over every layer and head, or one
    layer's full grids (`layer` set), with the tokens they are over."""

    ids: list[int]
    labels: list[str]
    tokens: list[str]  # each token's text, \xNN for bytes that are not UTF-8 on their own
    dropped: int  # tokens cut from the front to fit block_size
    position: int
    n_layer: int
    n_head: int
    layer: int | None
    head: int | None  # with a layer: the one head asked for
    weights: torch.Tensor  # (L, H, position + 1) without a layer, else (H, T, T) of that layer
    windows: tuple[int, ...]  # the positions each layer's queries see, themselves included

    def to_json(self, model: str) -> dict[str, object]:
        out: dict[str, object] = {
            "model": model, "ids": self.ids, "tokens": self.tokens, "dropped": self.dropped,
            "position": self.position, "n_layer": self.n_layer, "n_head": self.n_head,
            "windows": list(self.windows),
        }  # fmt: skip
        if self.layer is None:
            out["weights"] = [[[round(w, 6) for w in r] for r in hs] for hs in self.weights.tolist()]
            return out
        grids = [[[round(w, 6) for w in r] for r in self.weights[h].tolist()] for h in self.heads]
        out.update(layer=self.layer, weights=grids if self.head is None else grids[0])
        if self.head is not None:
            out["head"] = self.head
        return out

    @property
    def heads(self) -> list[int]:
        return list(range(self.n_head)) if self.head is None else [self.head]


def inspect_text(
    model: GPT, tokenizer: Tokenizer, text: str, cfg: AttentionConfig = AttentionConfig()
) -> Inspection:
    """The attention `minigpt attention` shows for `text` (its last block_size tokens) at `cfg`'s position,
    layer and head."""
    position, layer, head = cfg.position, cfg.layer, cfg.head
    if not text:
        raise UsageError("TEXT is empty: give some text to look at")
    config = model.config
    ids = tokenizer.encode(text)
    dropped = max(0, len(ids) - config.block_size)
    ids = ids[dropped:]
    pos = resolve_index(-1 if position is None else position, len(ids), "position", "tokens")
    li = None if layer is None else resolve_index(layer, config.n_layer, "layer", "layers")
    hi = None if head is None else resolve_index(head, config.n_head, "head", "heads")
    ids = ids[: pos + 1]  # causal: tokens after pos change nothing at or before it
    weights = attention_row(model, ids) if li is None else attention_maps(model, ids).weights[li]
    tokens = [tokenizer.decode_bytes([i]).decode("utf-8", errors="backslashreplace") for i in ids]
    labels = token_labels(tokenizer, ids)
    return Inspection(
        ids,
        labels,
        tokens,
        dropped,
        pos,
        config.n_layer,
        config.n_head,
        li,
        hi,
        weights,
        config.layer_windows,
    )


# --------------------------------------------------------------------------- generate --explain


@dataclass(frozen=True)
class Attended:
    """One attended token: its position in the ids given, its label and the weight on it."""

    position: int
    label: str
    weight: float


@dataclass(frozen=True)
class HeadFocus:
    """The tokens one head weighted most from the last position."""

    layer: int
    head: int
    top: list[Attended]


def explain_last(model: GPT, ids: Sequence[int], tokenizer: Tokenizer, top: int = 3) -> list[HeadFocus]:
    """For the last position, each last-layer head's `top` most attended tokens (the position itself included).

    Ids longer than block_size are cropped to the last block_size (as generation does); positions still
    index into the ids given.
    """
    if top < 1:
        raise UsageError(f"top must be at least 1, got {top}")
    offset = max(0, len(ids) - model.config.block_size)
    window = list(ids[offset:])
    if not window:
        raise UsageError("there are no tokens to explain: give some text")
    row = attention_row(model, window)[-1]  # (H, T) of the last layer
    labels: dict[int, str] = {}
    out = []
    for head in range(row.size(0)):
        picks = []
        for p, w in top_attended(row[head], top):
            if p not in labels:
                labels[p] = token_label(tokenizer.decode_bytes([window[p]]))
            picks.append(Attended(position=offset + p, label=labels[p], weight=w))
        out.append(HeadFocus(layer=model.config.n_layer - 1, head=head, top=picks))
    return out
