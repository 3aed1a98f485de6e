"""The model against references: shapes, causality, SDPA vs manual attention, loss at init."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT, attend, qkv

TINY = GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=4, n_embd=32)


def manual_attention(w, x: torch.Tensor) -> torch.Tensor:
    """Plain matmul-softmax causal attention, the textbook reference for SDPA."""
    B, T, C = x.shape
    q, k, v = qkv(w, x)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return F.linear(y, w.c_proj.weight, w.c_proj.bias)


def test_forward_shapes() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    none, loss = model(idx, idx)
    assert none is None and loss is not None and loss.ndim == 0
    full, _ = model(idx, all_logits=True)
    assert full.shape == (3, 10, TINY.vocab_size)
    last, none = model(idx)
    assert last.shape == (3, TINY.vocab_size) and none is None
    torch.testing.assert_close(last, full[:, -1, :])


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("chunk_elements", [1 << 22, 3 * TINY.vocab_size])  # one chunk; chunks of 3 rows
@pytest.mark.parametrize("multiple", [1, 7, 128])  # the head padded with zero rows, as on a GPU
def test_loss_and_gradients_equal_cross_entropy_of_the_logits(
    cap: float | None, chunk_elements: int, multiple: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss (head_loss, chunked, gradients from the forward pass) against F.cross_entropy of the whole
    logits, in float64 so that only the order of the sums differs: value and every parameter's gradient,
    with ignored (-1) targets scattered through the batch and none in one row; also with the head's rows
    padded to a multiple of 7 or 128 (the padding takes no probability and gets no gradient)."""
    assert TINY.vocab_size % 7 and TINY.vocab_size % 128
    monkeypatch.setattr("minigpt.model.head_loss.HEAD_LOSS_ELEMENTS", chunk_elements)
    monkeypatch.setattr("minigpt.model.head_loss.HEAD_ROW_MULTIPLE", {"cpu": multiple})
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY.__dict__, "logit_cap": cap})).double()
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    targets = torch.randint(0, TINY.vocab_size, (3, 10))
    targets[0, ::3] = -1
    targets[2] = -1
    _, loss = model(idx, targets)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, _ = model(idx, all_logits=True)
    want = F.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1), ignore_index=-1)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_loss_without_gradients_and_with_nothing_to_predict() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        _, loss = model(idx, idx)
        logits, _ = model(idx, all_logits=True)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, TINY.vocab_size), idx.reshape(-1)))
    assert torch.isnan(model(idx, torch.full_like(idx, -1))[1])  # as F.cross_entropy: 0 / 0


def test_an_evaluation_computes_no_head_gradients() -> None:
    """Under no_grad the head loss multiplies by the head once (the logits); with gradients, twice more (the
    gradients of the hidden states and of the head, computed in the forward pass)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadProducts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and any(
                TINY.vocab_size in shape for shape in shapes
            ):
                self.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, 8))
    for grad_mode, products in ((False, 1), (True, 3)):
        with torch.set_grad_enabled(grad_mode), HeadProducts() as counted:
            _, loss = model(idx, idx)
        assert counted.count == products and loss.requires_grad == grad_mode


def test_causality() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = idx.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % TINY.vocab_size
    a, _ = model(idx, all_logits=True)
    b, _ = model(changed, all_logits=True)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("bias", [True, False])
def test_sdpa_matches_manual_attention(bias: bool) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=4, n_embd=32, bias=bias)
    attn = GPT(config).weights().h[0].attn
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(attend(attn, x, 0), manual_attention(attn, x))
        probs: list[torch.Tensor] = []
        torch.testing.assert_close(attend(attn, x, 0, attention=probs), manual_attention(attn, x))
        assert probs[0].shape == (2, 4, 16, 16)


def test_loss_at_init_is_near_uniform() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, block_size=32, n_layer=2, n_head=2, n_embd=64)
    idx, targets = torch.randint(0, 500, (2, 8, 32))
    _, loss = GPT(config)(idx, targets)
    assert abs(loss.item() - math.log(500)) < 0.1


def test_tied_and_untied_heads() -> None:
    tied = GPT(TINY)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    untied = GPT(GPTConfig(**{**TINY.to_dict(), "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() == tied.num_params() + TINY.vocab_size * TINY.n_embd


def test_residual_projection_init_is_scaled() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=100, block_size=8, n_layer=8, n_head=4, n_embd=256)
    model = GPT(config)
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001


def test_too_long_sequence_is_a_clean_error() -> None:
    model = GPT(TINY)
    with pytest.raises(MinigptError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_embd=30, n_head=4), "divisible"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(dropout=1.0), "dropout"),
        (dict(block_size=2.5), "block_size"),
    ],
)
def test_config_validation(fields: dict, message: str) -> None:
    with pytest.raises(MinigptError, match=message):
        GPTConfig(**fields)


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.5))
    idx = torch.randint(0, 53, (2, 16))
    model.eval()
    a, _ = model(idx)
    b, _ = model(idx)
    torch.testing.assert_close(a, b)
    model.train()
    c, _ = model(idx)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_expected_shapes_without_torch_match_the_module(bias: bool, tied: bool) -> None:
    from minigpt.model.build import model_tensors
    from minigpt.model.weights import check_shapes, expected_shapes

    config = GPTConfig(
        vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, bias=bias, tie_embeddings=tied
    )
    real = {k: tuple(v.shape) for k, v in model_tensors(GPT(config)).items()}
    assert expected_shapes(config) == real
    check_shapes(config, real, Path("w"))
    with pytest.raises(MinigptError, match="missing transformer.h.0.attn.c_attn.weight"):
        check_shapes(config, {k: v for k, v in real.items() if "h.0.attn.c_attn.weight" not in k}, Path("w"))
    with pytest.raises(
        MinigptError, match=r"transformer.wpe.weight has shape \[9, 8\], config says \[8, 8\]"
    ):
        check_shapes(config, {**real, "transformer.wpe.weight": (9, 8)}, Path("w"))


@pytest.mark.parametrize("keys", [8, 16])
def test_cpu_half_attention_runs_in_float32_over_few_keys(monkeypatch, keys: int) -> None:
    """Under bf16 autocast on the CPU, attention over at most CPU_HALF_ATTENTION_MAX_KEYS keys is computed in
    float32 from the bf16 q, k, v (torch's bf16 kernel is slower there) and handed back in bf16; over more
    keys it stays in bf16. Either way: the textbook attention of the bf16 inputs, to bf16's rounding."""
    import minigpt.model.fused_attention as model_module

    monkeypatch.setattr(model_module, "CPU_HALF_ATTENTION_MAX_KEYS", 8)
    seen: list[torch.dtype] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, keys, 8).bfloat16().requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model_module.fused_attention(q, k, v, None, True, dropout=0.0, scale=None)
    assert seen == [torch.float32 if keys <= 8 else torch.bfloat16] and y.dtype == torch.bfloat16
    q64, k64, v64 = q.double(), k.double(), v.double()
    scores = (q64 @ k64.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(~torch.tril(torch.ones(keys, keys, dtype=torch.bool)), float("-inf"))
    reference = scores.softmax(-1) @ v64
    # one bf16 rounding of the output (2^-8 relative), plus bf16 arithmetic inside the kernel over more keys
    bound = 2.0**-8 if keys <= 8 else 2.0**-6
    torch.testing.assert_close(y.double(), reference, rtol=bound, atol=bound)
    y.float().sum().backward()  # gradients reach the bf16 inputs through the casts
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
