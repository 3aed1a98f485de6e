"""The torch engine: model.py's GPT behind the decode loop, on any device and dtype, with torch's sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minigpt.kvcache import KVCache
from minigpt.model import GPT
from minigpt.quantize import quantize_weights

__all__ = ["TorchEngine", "make_generator", "sample_next"]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next-token ids (B,) from last-position logits (B, V), by the rules of `Engine.sample`.

    Top-k and top-p compose in that order; one token is drawn per row with `generator`.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    vocab = logits.size(-1)
    if top_k is not None and top_k < vocab:
        # scatter exactly k values: a `logits < kth` mask would keep every token tied with the k-th
        values, indices = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, indices, values)
    if top_p is not None and top_p < 1:
        sorted_logits, indices = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, indices, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TorchEngine:
    """A GPT as the decode loop's Engine: prefill and every step go through GPT.forward.

    The engine reads the model's weight tree once (`GPT.weights`), so each step skips the module lookups,
    and with `quantize` keeps its linear layers in that form (minigpt.quantize) for every step.
    """

    name = "torch"

    def __init__(self, model: GPT, quantize: str = "none") -> None:
        self.model = model
        self.block_size = model.config.block_size
        self.rotary = model.config.pos == "rope"
        w = model.transformer.wte.weight
        self._device = w.device
        self.device = str(w.device)
        self.dtype = str(w.dtype).removeprefix("torch.")
        self.quantize = quantize
        self.weights = quantize_weights(model.weights(), quantize)

    @torch.inference_mode()
    def new_cache(self, batch: int) -> KVCache[torch.Tensor]:
        return self.model.new_cache(batch)

    @torch.inference_mode()
    def forward(self, ids: Sequence[Sequence[int]], cache: KVCache[torch.Tensor] | None) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long, device=self._device)
        logits, _ = self.model(idx, kv_cache=cache, weights=self.weights)
        return logits if cache is None else logits.expand(cache.batch, -1)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        rng: torch.Generator,
    ) -> list[int]:
        return sample_next(logits, temperature, top_k, top_p, rng).tolist()

    def rng(self, seed: int) -> torch.Generator:
        return make_generator(seed, self._device)
