"""The fast path of attention: torch's fused kernel, F.scaled_dot_product_attention (no I/O).

`gpt.causal_attention` writes attention out step by step (scores, mask, weights, weighted sum) and hands
the same computation to this kernel whenever nothing needs the weights themselves: it never holds the
(T, keys) scores, and picks the fastest implementation the device has (FlashAttention on a GPU). The one
rule added here is precision on the CPU, where torch's half-precision kernel loses to float32 over few keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch's CPU attention kernel in bf16 is slower than the float32 one over few keys (its inputs cast up and
# its output down included) and faster only over many; so on the CPU, attention in half precision (autocast,
# or a bf16 model) over at most this many keys runs in float32, which makes bf16 training of a small model
# faster than float32 rather than no faster (bench/bench_cpu_bf16.py measures where the two cross)
CPU_HALF_ATTENTION_MAX_KEYS = 256


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
    over T keys), scores scaled by `scale` (None: 1/√hd); in float32 where CPU_HALF_ATTENTION_MAX_KEYS
    says."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.device.type == "cpu" and half and k.size(2) <= CPU_HALF_ATTENTION_MAX_KEYS:
        with torch.autocast("cpu", enabled=False):
            y = fused_attention(q.float(), k.float(), v.float(), mask, is_causal, dropout, scale)
        return y.to(q.dtype)
    gqa = k.size(1) != q.size(1)  # each key/value head serves a group of query heads
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
