"""The torch engine: minigpt.model.gpt's GPT behind the decode loop, on any device and dtype, with torch's sampling."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from minigpt.errors import UsageError
from minigpt.generate.config import KV_CACHES
from minigpt.generate.engines.tuning import (
    TORCH_ENV,
    ThreadTuner,
    best_times,
    cores,
    env_threads,
    model_key,
    pick_layout,
    thread_candidates,
)
from minigpt.model.gpt import GPT
from minigpt.model.kvcache import KVCache, gather_rows
from minigpt.model.quantize import quantize_weights
from minigpt.model.weights import ModelWeights, for_decoding

__all__ = ["LAYOUTS", "TorchEngine", "make_generator", "sample_next", "torch_tuner"]


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
    # the largest logit shifted to 0 before dividing, by at least float32's smallest normal: any temperature
    # a user can type (1e-40 is a float32 subnormal, 1e-320 rounds to 0 there) then gives 0 and -inf, never
    # inf - inf = NaN; a colder temperature than that is argmax already
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
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


LAYOUTS = ("auto", "output-major", "input-major")


class TorchEngine:
    """A GPT as the decode loop's Engine: prefill and every step go through minigpt.model.gpt's forward pass.

    The engine reads the model's weight tree once (`GPT.weights`), so each step skips the module lookups,
    fuses SwiGLU's gate and up-projection into one product, and keeps its linear layers in `quantize` form
    (minigpt.model.quantize) or, in float, in `layout`: 'output-major' (torch's own), 'input-major' (transposed
    copies) or 'auto', which on the CPU times a one-token step in each and keeps the faster. CPU threads:
    `threads` fixes them, else OMP_NUM_THREADS does, else they are chosen by timing the steps
    (`minigpt.generate.engines.tuning`).
    """

    name = "torch"
    path = ""  # one way of decoding: torch's modules

    def __init__(
        self,
        model: GPT,
        quantize: str = "none",
        *,
        layout: str = "output-major",
        threads: int | None = None,
        kv_cache: str | None = None,
    ) -> None:
        """`kv_cache`: what the KV cache holds keys and values in, float32 or float16 (None: the model's
        dtype); attention widens them to the model's dtype as it reads them."""
        if layout not in LAYOUTS:
            raise UsageError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
        if kv_cache not in (None, *KV_CACHES[1:]):
            raise UsageError(f"unknown KV cache type {kv_cache!r}: choose one of {', '.join(KV_CACHES[1:])}")
        self.model = model
        self.block_size = model.config.block_size
        self.rotary = model.config.pos == "rope"
        w = model.transformer.wte.weight
        self._device = w.device
        self.device = str(w.device)
        self.dtype = str(w.dtype).removeprefix("torch.")
        self.quantize = quantize
        self.kv_cache = self.dtype if kv_cache is None else kv_cache
        cpu = w.device.type == "cpu"
        self.tuner = torch_tuner(threads) if cpu else ThreadTuner(lambda: 1, lambda n: None, [1])
        with torch.no_grad():
            tree = quantize_weights(for_decoding(model.weights(), torch.cat), quantize)
        forms = {"output-major": lambda: tree}
        if quantize == "none":  # int8 weights have the one layout their kernel reads
            forms["input-major"] = lambda: for_decoding(tree, torch.cat, _transposed)
        key = {
            "engine": "torch",
            "torch": torch.__version__,
            "dtype": self.dtype,
            "model": model_key(model.config),
        }
        self.layout, self.weights = pick_layout(layout, forms, self._step_times, key, cpu)

    @property
    def threads(self) -> int:
        return self.tuner.last

    @torch.inference_mode()
    def new_cache(self, batch: int, capacity: int | None = None) -> KVCache[torch.Tensor]:
        return self.model.new_cache(batch, getattr(torch, self.kv_cache), capacity)

    @torch.inference_mode()
    def forward(
        self,
        ids: Sequence[Sequence[int]],
        cache: KVCache[torch.Tensor] | None,
        *,
        every_position: bool = False,
    ) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long, device=self._device)
        rows, new = idx.shape
        with self.tuner.step((rows, new == 1), work=new):
            return self._forward(self.weights, idx, cache, every_position)

    def _forward(
        self,
        weights: ModelWeights[torch.Tensor],
        idx: torch.Tensor,
        cache: KVCache[torch.Tensor] | None,
        every_position: bool,
    ) -> torch.Tensor:
        logits, _ = self.model(idx, kv_cache=cache, all_logits=every_position, weights=weights)
        if cache is None or logits.size(0) == cache.batch:
            return logits
        return logits.expand(cache.batch, *logits.shape[1:])

    @torch.inference_mode()
    def _step_times(self, trees: dict[str, ModelWeights[torch.Tensor]]) -> dict[str, float]:
        """Each layout's best time for a one-token step, on the thread count a step starts with."""
        cache = self.new_cache(1)
        idx = torch.zeros((1, 1), dtype=torch.long, device=self._device)
        self.tuner.use(self.tuner.candidates[0])

        def step(name: str) -> Callable[[], object]:
            return lambda: (cache.reset(), self._forward(trees[name], idx, cache, False))

        return best_times({name: step(name) for name in trees})

    @torch.inference_mode()
    def gather(self, parts: Sequence[tuple[KVCache[torch.Tensor], int, int]]) -> KVCache[torch.Tensor]:
        return gather_rows(self.new_cache, parts)

    @torch.inference_mode()
    def log_probs(self, logits: torch.Tensor) -> np.ndarray:
        return torch.log_softmax(logits.double(), dim=-1).cpu().numpy()

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


@torch.no_grad()
def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def torch_tuner(threads: int | None = None) -> ThreadTuner:
    """A tuner over torch's CPU threads: `threads` fixed, else OMP_NUM_THREADS's (or MKL_NUM_THREADS's),
    else chosen by timing among `thread_candidates(cores())`."""
    fixed = threads or env_threads(TORCH_ENV)
    candidates = [fixed] if fixed else thread_candidates(cores())
    return ThreadTuner(torch.get_num_threads, torch.set_num_threads, candidates)
