"""Attention as bf16 products on the CPU (minigpt.model.fused_attention.ProductAttention): its hand-written
backward against finite differences, its output against torch's kernel and float64, and where it runs.
Measuring it against float32 is in test_train_tuning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import minigpt.model.fused_attention as fa
from minigpt.cli.main import app
from minigpt.common.settings import options_of
from minigpt.errors import UsageError
from minigpt.model.config import GPTConfig
from minigpt.train.config import TrainConfig
from minigpt.train.step import Runtime

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
TINY = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32)


def inputs(dtype: torch.dtype, kv_heads: int = 4, queries: int = 8, keys: int = 8) -> Tensors:
    torch.manual_seed(0)
    q = torch.randn(2, 4, queries, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, keys, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("causal", "queries", "kv_heads"),
    [(True, 8, 4), (False, 1, 4), (False, 5, 4), (True, 8, 2), (True, 8, 1)],
)
def test_products_are_torchs_attention_and_their_backward_is_exact(
    causal: bool, queries: int, kv_heads: int
) -> None:
    """In float64: torch's kernel's output (causal, a few queries over every key, grouped-query), and
    gradcheck holds the written-out backward to finite differences."""
    q, k, v = inputs(torch.float64, kv_heads=kv_heads, queries=queries)
    out = fa.product_attention(q, k, v, causal, 0.3)
    gqa = kv_heads != 4
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: fa.product_attention(*t, causal, None), (q, k, v))


def causal_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
    """Textbook causal attention in float64 of copies of q, k, v, and the copies (for their gradients)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-2, -1)) / math.sqrt(q.size(-1))
    keys = k.size(2)
    scores = scores.masked_fill(~torch.tril(torch.ones(keys, keys, dtype=torch.bool)), float("-inf"))
    return scores.softmax(-1) @ v64, (q64, k64, v64)


def spy_kernel(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of each call of torch's fused kernel from fused_attention."""
    seen: list[torch.dtype] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        seen.append(q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(fa.F, "scaled_dot_product_attention", spy)
    return seen


def test_bf16_products_run_when_asked_and_hold_bf16s_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast in a Runtime that asks for bf16 attention: the products, not torch's kernel,
    compute causal attention of bf16 inputs, and output and gradients keep to bf16's rounding of float64's."""
    kernel = spy_kernel(monkeypatch)
    q, k, v = inputs(torch.bfloat16)
    runtime = Runtime(torch.device("cpu"), torch.bfloat16, attention_dtype=torch.bfloat16)
    with runtime.autocast():
        y = fa.fused_attention(q, k, v, None, True, dropout=0.0, scale=None)
    assert kernel == [] and y.dtype == torch.bfloat16
    reference, leaves = causal_float64(q, k, v)
    # scores under 4 in size, rounded to bf16 (2^-8 relative), move a weight by up to 4 * 2^-8 relative;
    # the output's own rounding adds 2^-8
    bound = 5 * 2.0**-8
    torch.testing.assert_close(y.double(), reference, rtol=bound, atol=bound)
    grad = torch.randn_like(reference)
    y.backward(grad.bfloat16())
    reference.backward(grad)
    for got, want in zip((q, k, v), leaves, strict=True):  # the backward rounds to bf16 once more
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=2 * bound, atol=2 * bound)


@pytest.mark.parametrize("case", ["not asked", "mask", "dropout", "float16", "many keys"])
def test_otherwise_half_attention_keeps_torchs_kernel(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Products run only when asked, on bf16, without a mask or dropout, over few keys; else torch's kernel
    as before (float32 copies over few keys, the half dtype itself over many)."""
    monkeypatch.setattr(fa, "CPU_HALF_ATTENTION_MAX_KEYS", 4 if case == "many keys" else 8)
    kernel = spy_kernel(monkeypatch)
    q, k, v = inputs(torch.float16 if case == "float16" else torch.bfloat16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril() if case == "mask" else None
    asked = torch.float32 if case == "not asked" else torch.bfloat16
    with fa.cpu_half_attention(asked):
        fa.fused_attention(q, k, v, mask, mask is None, 0.1 if case == "dropout" else 0.0, None)
    assert kernel == [q.dtype if case == "many keys" else torch.float32]


def test_products_apply_to_few_keys_without_dropout_through_the_fused_path() -> None:
    assert fa.products_apply(TINY)
    assert fa.products_apply(GPTConfig(**{**TINY.to_dict(), "window": 4}))  # the last layer sees all
    for change in ({"block_size": 512}, {"dropout": 0.1}, {"attn_score": "additive"}):
        assert not fa.products_apply(GPTConfig(**{**TINY.to_dict(), **change}))


def test_the_options_help_states_the_kernels_key_limit() -> None:
    """--attention-dtype's help (torch-free, so it cannot read the constant) says the limit the kernel keeps."""
    (option,) = (o for o in options_of(TrainConfig) if o.name == "attention_dtype")
    assert f"at most {fa.CPU_HALF_ATTENTION_MAX_KEYS} keys" in option.setting.help


def test_a_bad_attention_dtype_is_refused_in_one_line(runner, tmp_path) -> None:  # noqa: ANN001
    """The option and the config refuse what is neither auto nor a dtype the choice knows."""
    with pytest.raises(UsageError, match="attention_dtype"):
        TrainConfig(attention_dtype="float16")
    corpus = tmp_path / "t.txt"
    corpus.write_text("hello world\n" * 50, encoding="utf-8")
    result = runner.invoke(
        app, ["train", str(corpus), "--attention-dtype", "float16", "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and "--attention-dtype" in result.output
    assert not (tmp_path / "r").exists()
