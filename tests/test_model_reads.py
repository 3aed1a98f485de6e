"""What a learner reads in minigpt/model/gpt.py: GPT-2's path on a few screens, top to bottom in the order the
data flows and the textbook's words, with the variants' details in modules of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import minigpt.model.gpt

GPT_PY = Path(minigpt.model.gpt.__file__)
# the steps of the default path, in the order the file must name them (each one's first mention after the
# module's docstring, which lists the variants)
STEPS = (
    "token embedding",
    "query, key and value projections",
    "scaled scores",
    "causal mask",
    "softmax",
    "weighted sum of the values",
    "heads concatenated",
    "output projection",
    "final norm",
    "LM head",
)
# fields and calls only a variant's module needs: the default path reaches them through one named point
VARIANT_DETAILS = (
    "score_maps", "v_embed", "q_norm", "k_norm", "skip_pairs", "fused_gate", "lora_A", "lora_B",
    "_weight_int8pack_mm", "checkpoint(", "autocast", "float16", "torch.tanh", "rotate(",
)  # fmt: skip


def _code_lines() -> list[tuple[int, str]]:
    """gpt.py's lines after its module docstring, numbered from 1 as `grep -n` numbers them."""
    text = GPT_PY.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno or 0
    return list(enumerate(text.splitlines(), 1))[docstring_end:]


def test_the_model_file_is_at_most_350_lines() -> None:
    assert len(GPT_PY.read_text().splitlines()) <= 350


def test_the_default_path_names_its_steps_in_order() -> None:
    lines = _code_lines()
    first = {step: next((n for n, line in lines if step in line), None) for step in STEPS}
    assert None not in first.values(), first
    assert list(first.values()) == sorted(first.values()), first


def test_the_explicit_attention_sits_beside_the_fused_kernel_it_equals() -> None:
    """The fast path names the call nanoGPT shows, and the explicit steps follow it in the same function."""
    text = GPT_PY.read_text()
    fused = text.index("F.scaled_dot_product_attention(q, k, v, is_causal=True)")
    assert fused < text.index("# the scaled scores") < text.index("def attend(")


def test_the_variants_details_stay_in_their_modules() -> None:
    text = "\n".join(line for _, line in _code_lines())
    assert [detail for detail in VARIANT_DETAILS if detail in text] == []
