"""Weight-only int8 quantization of a model's weight tree for decoding on the CPU (generate, eval).

A cached decoding step reads every weight once per token, so its speed follows the bytes it reads: int8
weights are a quarter of float32's. Each linear weight becomes int8 with one symmetric scale per output
channel (scale = max |w| / 127 of that row), and `int8_linear` (where `minigpt.model.gpt.linear` hands such
a layer) multiplies through PyTorch's CPU kernel for that layout (`torch._weight_int8pack_mm`). Activations,
norms, biases, the embeddings, the LM head and the KV cache keep the model's dtype; only the linear layers'
inputs pass through bf16, the dtype the kernel is fast in.
"""

from __future__ import annotations

import torch

from minigpt.errors import UsageError
from minigpt.model.weights import QUANTIZATIONS, LinearWeights, ModelWeights, map_linears

__all__ = ["QUANTIZATIONS", "check_quantize", "int8_linear", "quantize_int8", "quantize_weights"]


def check_quantize(quantize: str, device: torch.device | str) -> None:
    """Reject a quantization this build cannot run, with a one-line message."""
    if quantize not in QUANTIZATIONS:
        raise UsageError(f"unknown quantization {quantize!r}: choose one of {', '.join(QUANTIZATIONS)}")
    if quantize != "none" and torch.device(device).type != "cpu":
        raise UsageError(f"--quantize {quantize} runs on the CPU: add --device cpu or drop --quantize")


def quantize_int8(w: LinearWeights[torch.Tensor]) -> LinearWeights[torch.Tensor]:
    """The int8 form of one linear layer: per-output-channel symmetric scales, rounded to nearest."""
    weight = (w.weight.t() if w.input_major else w.weight).detach().float()
    kernel_dtype = torch.bfloat16 if w.weight.dtype == torch.float32 else w.weight.dtype
    # round the scales to the dtype the kernel multiplies by first, so the int8 values are chosen for them
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(kernel_dtype)
    q = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return LinearWeights(q.contiguous(), w.bias, scale)


def quantize_weights(weights: ModelWeights[torch.Tensor], quantize: str) -> ModelWeights[torch.Tensor]:
    """The tree with every linear layer in `quantize` form ('none': the tree itself). New tensors: the
    model's own parameters are left as they are."""
    if quantize == "none":
        return weights
    check_quantize(quantize, weights.wte.device)
    with torch.no_grad():
        return map_linears(weights, quantize_int8)


def int8_linear(w: LinearWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x through the int8 layer w: x Wᵀ + b with W the int8 rows times their scales."""
    # the kernel takes activations in the scales' dtype, bf16 for float32 models because its float32 path is
    # several times slower; results return to x's dtype
    y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)).to(w.scale.dtype), w.weight, w.scale)
    y = y.view(*x.shape[:-1], -1)
    return y.to(x.dtype) if w.bias is None else w.bias + y  # the sum promotes to the bias's dtype, x's
