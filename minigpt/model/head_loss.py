"""The training loss through the LM head, a chunk of rows at a time (no I/O).

The loss is the mean cross-entropy of the head's logits against the next tokens, F.cross_entropy's value;
computed whole, the (B x T, V) logits, their softmax and their gradient would each be B·T·V floats, far
more than the model for a large vocabulary. `head_loss` (from `GPT.forward`) computes them a chunk of rows
at a time and takes each chunk's gradients in the forward pass (`_HeadLoss`), so they never exist whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigpt.model.weights import ModelWeights

# logits per chunk of rows on the CPU: a bounded temporary, whatever the batch and the vocabulary
HEAD_LOSS_ELEMENTS = 1 << 22
# logits per chunk on a GPU: each chunk adds its head gradient into a float32 copy of the head and launches
# a dozen kernels, so small chunks spend the step on that rather than on the products
ACCELERATOR_HEAD_LOSS_ELEMENTS = 1 << 27
# the head's products run on a vocabulary padded with zero rows to a multiple of this (its logits -inf), by
# device type: a GPU's matrix kernels need 16-byte aligned rows, and on an odd vocabulary such as GPT-2's
# cuBLAS falls back to far slower kernels; the CPU's BLAS has no such cliff
HEAD_ROW_MULTIPLE = {"cpu": 1}
ACCELERATOR_HEAD_ROW_MULTIPLE = 128


def head_loss(w: ModelWeights[torch.Tensor], x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the head's logits of hidden states x (B, T, C) against targets (B, T;
    -1 is not predicted), F.cross_entropy's value, computed a chunk of rows at a time with its gradients
    (_HeadLoss): the (B x T, V) logits, their softmax and their gradient never exist whole."""
    rows = x.reshape(-1, x.size(-1))
    gpu = x.device.type != "cpu"
    elements = ACCELERATOR_HEAD_LOSS_ELEMENTS if gpu else HEAD_LOSS_ELEMENTS
    multiple = HEAD_ROW_MULTIPLE.get(x.device.type, ACCELERATOR_HEAD_ROW_MULTIPLE)
    chunk = max(1, elements // w.lm_head.size(0))
    # forward() runs with grad mode off, so whether gradients are wanted (not in an evaluation) is read here
    grads = torch.is_grad_enabled() and (rows.requires_grad or w.lm_head.requires_grad)
    return _HeadLoss.apply(rows, w.lm_head, targets.reshape(-1), w.logit_cap, chunk, grads, multiple)


class _HeadLoss(torch.autograd.Function):
    """Cross-entropy through the LM head, its gradients computed in the forward pass, chunk by chunk
    (the softmax minus the one-hot target is the logits' gradient), so backward only scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        cap: float | None,
        chunk: int,
        grads: bool,
        multiple: int,
    ) -> torch.Tensor:
        wanted = targets >= 0
        count = wanted.sum()
        vocab = weight.size(0)
        ctx.weight_dtype = weight.dtype  # type: ignore[attr-defined]
        wide = torch.promote_types(weight.dtype, torch.float32)  # sums in float32 at least
        # zero rows, their logits set to -inf
        padded = F.pad(weight, (0, 0, 0, -vocab % multiple)) if vocab % multiple else weight
        gx = torch.zeros_like(x) if grads else None
        gw = torch.zeros_like(padded, dtype=wide) if grads else None
        total = torch.zeros((), dtype=wide, device=x.device)
        for start in range(0, x.size(0), chunk):
            part = slice(start, start + chunk)
            loss, g = _chunk_loss(x[part], padded, vocab, targets[part], wanted[part], cap, wide, grads)
            total += loss
            if g is not None:
                gx[part] = (g.to(weight.dtype) @ padded).to(x.dtype)
                gw += (g.t().to(x.dtype) @ x[part]).to(wide)
        ctx.save_for_backward(gx, None if gw is None else gw[:vocab], count)
        return total / count

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        gx, gw, count = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad / count
        return gx * scale.to(gx.dtype), (gw * scale).to(ctx.weight_dtype), None, None, None, None, None


def _chunk_loss(
    xs: torch.Tensor,
    weight: torch.Tensor,
    vocab: int,
    targets: torch.Tensor,
    ok: torch.Tensor,
    cap: float | None,
    wide: torch.dtype,
    grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed cross-entropy of one chunk of rows against `weight`'s first `vocab` rows (any rows after
    them take no part), and the gradient of that sum with respect to the logits (None unless `grads`)."""
    z = F.linear(xs, weight).to(wide)
    capped = None if cap is None else torch.tanh(z / cap)
    logits = z if capped is None else cap * capped
    if logits.size(1) > vocab:
        logits[:, vocab:] = float("-inf")  # padding: no probability, no gradient
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    loss = torch.where(ok, lse - picked, 0.0).sum()
    if not grads:
        return loss, None
    g = torch.exp(logits - lse[:, None])  # softmax, minus the target's one-hot below
    g.scatter_add_(1, targets.clamp(min=0)[:, None], -ok[:, None].to(g.dtype))
    g *= ok[:, None]
    if capped is not None:
        g *= 1 - capped * capped  # through cap * tanh(z / cap)
    return loss, g
