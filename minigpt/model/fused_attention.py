"""The fast paths of attention (no I/O): torch's fused kernel, F.scaled_dot_product_attention, and on the CPU
batched products in bf16 for few keys (`ProductAttention`).

`gpt.causal_attention` writes attention out step by step (scores, mask, weights, weighted sum) and hands
the same computation to this module whenever nothing needs the weights themselves. The fused kernel never
holds the (T, keys) weights and picks the fastest implementation the device has (FlashAttention on a GPU).
On the CPU, in half precision over few keys, torch's kernel loses to float32, so attention runs either
in float32 through that kernel or as bf16 products; which is faster depends on the CPU, so a training run
times both on its own shapes (minigpt.train.tuning) and sets the answer with `cpu_half_attention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from minigpt.model.config import GPTConfig

# torch's CPU attention kernel in bf16 is slower than the float32 one over few keys (its inputs cast up and
# its output down included) and faster only over many; so on the CPU, attention in half precision (autocast,
# or a bf16 model) over at most this many keys runs in float32 or as bf16 products (ProductAttention),
# which makes bf16 training of a small model faster than float32 rather than no faster
# (bench/bench_cpu_bf16.py measures where the two cross); beyond it the products' weights, B·H·T·keys of
# them kept for the backward pass, would cost more memory than the fused kernel saves time
CPU_HALF_ATTENTION_MAX_KEYS = 256
# the dtype that attention over few keys runs in on the CPU when its inputs are in half precision:
# float32 (torch's fused kernel on float32 copies) or torch.bfloat16 (ProductAttention, bf16 inputs only)
_CPU_HALF_ATTENTION: ContextVar[torch.dtype] = ContextVar("cpu_half_attention", default=torch.float32)


@contextlib.contextmanager
def cpu_half_attention(dtype: torch.dtype) -> Iterator[None]:
    """Within this block, half-precision attention over few keys on the CPU runs in `dtype` (float32 or
    torch.bfloat16: see _CPU_HALF_ATTENTION)."""
    token = _CPU_HALF_ATTENTION.set(dtype)
    try:
        yield
    finally:
        _CPU_HALF_ATTENTION.reset(token)


class ProductAttention(torch.autograd.Function):
    """Attention as three batched products in the inputs' dtype, its backward written out: the scores q·kᵀ
    (-inf added above the diagonal where causal), their softmax (accumulated in float32 by torch), and the
    weights' sum of the values. Unlike the fused kernel it keeps the weights (B·H, T, S) for the backward
    pass rather than computing them again, which over few keys costs little memory; and with a CPU's bf16
    products it runs about twice as fast as that kernel in float32 (bench/bench_cpu_choices.py)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
    ) -> torch.Tensor:
        B, H, T, D = q.shape
        q3, k3, v3 = (t.reshape(B * H, -1, D) for t in (q, k, v))
        # the scores, each query's row over the keys; causal: T queries over T keys, aligned top-left
        bias = torch.zeros((), dtype=q.dtype, device=q.device)
        if causal:
            bias = torch.full((T, k.size(2)), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
        weights = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale).softmax(dim=-1)
        ctx.save_for_backward(q3, k3, v3, weights)
        ctx.scale = scale
        return torch.bmm(weights, v3).view(B, H, T, D)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q3, k3, v3, weights = ctx.saved_tensors
        g = grad.reshape(q3.shape).to(weights.dtype)
        grad_v = torch.bmm(weights.transpose(1, 2), g)
        # through the softmax: weights * (dweights - the row's sum of weights * dweights), in one kernel
        grad_scores = torch._softmax_backward_data(
            torch.bmm(g, v3.transpose(1, 2)), weights, -1, weights.dtype
        )
        grad_q = torch.bmm(grad_scores, k3).mul_(ctx.scale)
        grad_k = torch.bmm(grad_scores.transpose(1, 2), q3).mul_(ctx.scale)
        shape, kv_shape = grad.shape, (*grad.shape[:2], -1, grad.size(-1))
        return grad_q.view(shape), grad_k.view(kv_shape), grad_v.view(kv_shape), None, None


def product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> torch.Tensor:
    """ProductAttention of q (B, H, T, hd) over k, v (B, n_kv_head, S, hd), in their dtype, autocast or not."""
    if k.size(1) != q.size(1):  # grouped-query attention: each key/value head serves a group of query heads
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with torch.autocast(q.device.type, enabled=False):
        out = ProductAttention.apply(q, k, v, q.size(-1) ** -0.5 if scale is None else scale, causal)
    return out  # type: ignore[no-any-return]


def products_apply(config: GPTConfig) -> bool:
    """Whether a training step of this model would run attention as bf16 products when `cpu_half_attention`
    asks: few enough keys, no dropout on the weights, and the fused path (not the additive score's). Local
    layers pass a mask to the fused kernel, but the last layer always sees its whole block."""
    fused = config.attn_score != "additive"
    return config.block_size <= CPU_HALF_ATTENTION_MAX_KEYS and not config.dropout and fused


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    dropout: float,
    scale: float | None,
) -> torch.Tensor:
    """The heads' outputs (B, H, T, hd) of queries q (B, H, T, hd) over keys and values (B, n_kv_head, S, hd)
    by torch's fused kernel: where `mask` is True (None: every key), or causally (`is_causal`: T queries
    over T keys), scores scaled by `scale` (None: 1/√hd); on the CPU in half precision over few keys, in
    float32 or as bf16 products, as `cpu_half_attention` says."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.device.type == "cpu" and half and k.size(2) <= CPU_HALF_ATTENTION_MAX_KEYS:
        if _CPU_HALF_ATTENTION.get() == q.dtype == torch.bfloat16 and mask is None and not dropout:
            return product_attention(q, k, v, is_causal, scale)
        with torch.autocast("cpu", enabled=False):
            y = fused_attention(q.float(), k.float(), v.float(), mask, is_causal, dropout, scale)
        return y.to(q.dtype)
    gqa = k.size(1) != q.size(1)  # each key/value head serves a group of query heads
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
