"""Text generation: a preallocated KV cache, top-k/top-p sampling, streamed UTF-8 text, the decode loop.

Context windowing (one policy, shared by the cached engine and the plain reference loop): a prompt longer
than block_size is cut to its last block_size tokens; the window then grows one token per step, and when
it would pass block_size its oldest `slide` tokens are dropped. Learned positions mean dropped tokens change
every remaining token's position, so the cached engine re-prefills the kept window in one forward pass;
with slide=1 this is exactly nanoGPT's crop-to-the-last-block_size loop (a re-prefill for every token),
with a larger slide one re-prefill serves `slide` tokens.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from minigpt.errors import MinigptError, UsageError
from minigpt.model import GPT
from minigpt.tokenizer import Tokenizer

__all__ = [
    "DecodeStep",
    "Generation",
    "KVCache",
    "SampleResult",
    "TextEvent",
    "TextStream",
    "check_sampling",
    "decode_tokens",
    "default_slide",
    "encode_prompt",
    "generate",
    "generate_uncached",
    "make_generator",
    "resolve_slide",
    "sample_next",
    "window_drop",
]


class KVCache:
    """Keys and values of every layer in preallocated (n_layer, B, H, block_size, hd) buffers.

    Implements the protocol GPT.forward expects: `update` writes in place (no concatenation per step) and
    returns views of everything cached so far; `advance` moves `pos` once all layers have written.
    """

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layer, batch, n_head, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views, so a step indexes one small tensor rather than the 5-d buffer
        self._k = [self.k[i] for i in range(n_layer)]
        self._v = [self.v[i] for i in range(n_layer)]
        self.block_size = block_size
        self.pos = 0

    @classmethod
    def for_model(cls, model: GPT, batch: int) -> KVCache:
        """A cache shaped for `model`, in its dtype and on its device."""
        c = model.config
        w = model.transformer.wte.weight
        return cls(c.n_layer, batch, c.n_head, c.block_size, c.head_dim, w.dtype, w.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, H, T, hd) at pos..pos+T; a 1-row update of an empty cache fills every row.

        That is how B samples share one prefill of their common prompt: the prompt runs as one row, its
        keys and values are broadcast into all B rows, and the following steps run all B rows.
        """
        rows, end = k.size(0), self.pos + k.size(2)
        if end > self.block_size:
            raise UsageError(f"KV cache overflow: {end} positions, room for {self.block_size}")
        if rows != self.k.size(1) and not (rows == 1 and self.pos == 0):
            raise UsageError(f"KV cache holds {self.k.size(1)} rows, got {rows}")
        kl, vl = self._k[layer], self._v[layer]
        kl[:, :, self.pos : end] = k
        vl[:, :, self.pos : end] = v
        return kl[:rows, :, :end], vl[:rows, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused, not freed)."""
        self.pos = 0


# --- the windowing policy -------------------------------------------------------------------------------


def default_slide(block_size: int) -> int:
    """A quarter of the context: a re-prefill of 3/4 block_size tokens every block_size/4 tokens."""
    return max(1, block_size // 4)


def resolve_slide(slide: int | None, block_size: int) -> int:
    if slide is None:
        return default_slide(block_size)
    if isinstance(slide, bool) or not isinstance(slide, int) or not 1 <= slide <= block_size:
        raise UsageError(f"slide must be between 1 and the model's block_size ({block_size}), got {slide!r}")
    return slide


def window_drop(length: int, block_size: int, slide: int) -> int:
    """How many of its oldest tokens a context window that has grown to `length` tokens must drop."""
    return slide if length > block_size else 0


# --- sampling -------------------------------------------------------------------------------------------


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject sampling settings that cannot work, with one-line messages."""
    if not temperature >= 0 or temperature == float("inf"):  # also catches NaN
        raise UsageError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"top-k must be at least 1 (1 is greedy), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"top-p must be in (0, 1] (1 keeps every token), got {top_p}")


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
    """Next-token ids (B,) from last-position logits (B, V).

    Temperature 0 is greedy (the generator is not touched). Otherwise the logits are divided by the
    temperature, cut to the top_k most likely tokens, then to the smallest set whose probability reaches
    top_p (top-k and top-p compose in that order), and one token is drawn per row with `generator`.
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


# --- token loops ----------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_uncached(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Reference loop: a full forward pass over the current window for every token; returns (B, N) ids.

    idx (B, T) holds B prompts, or one prompt (1, T) continued as num_samples rows.
    """
    block_size = model.config.block_size
    slide = resolve_slide(slide, block_size)
    seq = idx[:, -block_size:].expand(num_samples, -1) if num_samples > 1 else idx[:, -block_size:]
    start = 0
    new = []
    for _ in range(max_new_tokens):
        logits, _ = model(seq[:, start:])
        token = sample_next(logits, temperature, top_k, top_p, generator)
        new.append(token)
        seq = torch.cat([seq, token[:, None]], dim=1)
        start += window_drop(seq.size(1) - start, block_size, slide)
    return torch.stack(new, dim=1) if new else idx.new_empty(idx.size(0), 0)


class DecodeStep:
    """GPT.forward for one new token per row, written as a flat sequence of tensor ops.

    Prefills go through GPT.forward. A single-token step through the modules spends a fifth (1 CPU
    thread) to a third (2 threads) of its time on module calls, head reshapes and small copies; this
    reads the same parameters and skips all of that, giving bit-identical logits here. `supports` says
    when it applies (a GPT exactly as model.py defines it, in eval mode); tests hold it to GPT.forward.
    """

    def __init__(self, model: GPT) -> None:
        c = model.config
        t = model.transformer
        self.n_head, self.n_embd, self.head_dim = c.n_head, c.n_embd, c.head_dim
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.layers = [
            (
                b.ln_1.weight, b.ln_1.bias, b.ln_1.eps, b.attn.c_attn.weight, b.attn.c_attn.bias,
                b.attn.c_proj.weight, b.attn.c_proj.bias, b.ln_2.weight, b.ln_2.bias, b.ln_2.eps,
                b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.gelu.approximate, b.mlp.c_proj.weight,
                b.mlp.c_proj.bias,
            )
            for b in t.h
        ]  # fmt: skip
        self.ln_f = (t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
        self.head = model.lm_head.weight

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return type(model) is GPT and not model.training

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) after feeding token (B,) at position cache.pos; advances the cache."""
        pos, (B,), C = cache.pos, token.shape, self.n_embd
        if pos >= cache.block_size:
            raise UsageError(f"KV cache overflow: {pos + 1} positions, room for {cache.block_size}")
        x = F.embedding(token, self.wte) + self.wpe[pos]
        for i, layer in enumerate(self.layers):
            w1, b1, e1, wa, ba, wo, bo, w2, b2, e2, wf, bf, approximate, wp, bp = layer
            qkv = F.linear(F.layer_norm(x, (C,), w1, b1, e1), wa, ba)
            qkv = qkv.view(B, 3, self.n_head, 1, self.head_dim)
            k_all, v_all = cache.k[i, :, :, : pos + 1], cache.v[i, :, :, : pos + 1]
            k_all[:, :, pos:].copy_(qkv[:, 1])
            v_all[:, :, pos:].copy_(qkv[:, 2])
            y = F.scaled_dot_product_attention(qkv[:, 0], k_all, v_all)  # one query sees every key
            x = x + F.linear(y.view(B, C), wo, bo)
            h = F.gelu(F.linear(F.layer_norm(x, (C,), w2, b2, e2), wf, bf), approximate=approximate)
            x = x + F.linear(h, wp, bp)
        cache.advance(1)
        return F.linear(F.layer_norm(x, (C,), *self.ln_f), self.head)


@torch.inference_mode()
def decode_tokens(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next-token ids (B,) step by step: the prompts idx (B, T) are prefilled in one forward
    pass, then each step feeds one token per row through the KV cache. Same tokens as `generate_uncached`.

    With num_samples > 1, idx is one prompt (1, T): it is prefilled once as a single row and continued as
    num_samples rows. The next token is fed only when the caller asks for it, so stopping early wastes
    no forward pass.
    """
    block_size = model.config.block_size
    slide = resolve_slide(slide, block_size)
    if num_samples > 1 and idx.size(0) != 1:
        raise UsageError(f"num_samples={num_samples} needs one prompt, got {idx.size(0)}")
    batch = max(idx.size(0), num_samples)
    cache = KVCache.for_model(model, batch)
    window = torch.empty(batch, block_size, dtype=torch.long, device=idx.device)  # the cached tokens
    prompt = idx[:, -block_size:]
    window[:, : prompt.size(1)] = prompt
    if DecodeStep.supports(model):
        step_one = DecodeStep(model)
    else:

        def step_one(token: torch.Tensor, cache: KVCache) -> torch.Tensor:
            return model(token[:, None], kv_cache=cache)[0]

    logits, _ = model(prompt, kv_cache=cache)
    logits = logits.expand(batch, -1)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        if step + 1 == max_new_tokens:
            return
        pos = cache.pos
        drop = window_drop(pos + 1, block_size, slide)
        if drop:
            keep = pos - drop
            window[:, :keep] = window[:, drop:pos].clone()
            window[:, keep] = token
            cache.reset()
            logits, _ = model(window[:, : keep + 1], kv_cache=cache)
        else:
            window[:, pos] = token
            logits = step_one(token, cache)


# --- text -----------------------------------------------------------------------------------------------


class TextStream:
    """One sample's text: incremental UTF-8 decoding, stop strings, and how much is safe to show yet.

    Only complete characters are ever shown, and never a suffix that could still grow into a stop string,
    so the shown pieces concatenate to exactly the final `text`.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if any(s == "" for s in stop):
            raise UsageError("a stop string cannot be empty")
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.shown = 0
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, data: bytes) -> None:
        """Add the bytes of one more token (ignored once the text is finished)."""
        if not self.done:
            self._append(self._decoder.decode(data))

    def close(self, reason: str) -> None:
        """End the text (unless a stop string already did): flush a dangling partial character."""
        if not self.done:
            self._append(self._decoder.decode(b"", final=True))
        if not self.done:
            self.finish_reason = reason

    def _append(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - self._longest + 1)  # earlier text was already searched
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def _held(self) -> int:
        # the longest suffix of the text that is a proper prefix of a stop string
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def take(self) -> str:
        """Text that became safe to show since the last call."""
        end = len(self.text) if self.done else len(self.text) - self._held()
        if end <= self.shown:
            return ""
        piece = self.text[self.shown : end]
        self.shown = end
        return piece


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of the prompt; an empty prompt starts from <|endoftext|> where the tokenizer has it, else '\\n'."""
    if text:
        return tokenizer.encode(text)
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        return tokenizer.encode("\n")
    except MinigptError:
        raise MinigptError(
            "the prompt is empty and this model's tokenizer has neither <|endoftext|> nor a newline "
            "to start from: give a prompt"
        ) from None


class TextEvent(NamedTuple):
    """Newly shown text of one sample; `done` is set on that sample's last event."""

    sample: int
    text: str
    done: bool


@dataclass
class SampleResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length", "stop" (a stop string) or "end_of_text" (the model emitted <|endoftext|>)
    seconds: float  # from the start of the prefill until this sample finished

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class Generation:
    """One batched generation: every sample shares one prefill of the prompt.

    Iterate `events()` for the text as it becomes safe to show, then read `samples` and the timings.
    `stop` strings end a sample and are not part of its text; so does the tokenizer's <|endoftext|>.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        num_samples: int = 1,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop: Sequence[str] = (),
        slide: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be at least 1, got {max_new_tokens}")
        if num_samples < 1:
            raise UsageError(f"num-samples must be at least 1, got {num_samples}")
        if not prompt_ids:
            raise UsageError("the prompt has no tokens")
        check_sampling(temperature, top_k, top_p)
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.slide = resolve_slide(slide, model.config.block_size)
        self.streams = [TextStream(stop) for _ in range(num_samples)]
        self.token_ids: list[list[int]] = [[] for _ in range(num_samples)]
        self.finished_at = [0.0] * num_samples
        self.time_to_first_token = 0.0
        self.seconds = 0.0
        self.steps = 0

    def events(self) -> Iterator[TextEvent]:
        device = self.model.transformer.wte.weight.device
        idx = torch.tensor([self.prompt_ids], dtype=torch.long, device=device)
        generator = make_generator(self.seed, device)
        eot = self.tokenizer.eot_id
        decode_bytes = self.tokenizer.decode_bytes
        t0 = time.perf_counter()
        steps = decode_tokens(
            self.model, idx, self.max_new_tokens, num_samples=self.num_samples, slide=self.slide, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, generator=generator,
        )  # fmt: skip
        live = set(range(self.num_samples))
        for step, tokens in enumerate(steps):
            ids = tokens.tolist()
            now = time.perf_counter() - t0
            if step == 0:
                self.time_to_first_token = now
            self.steps = step + 1
            last = step + 1 == self.max_new_tokens
            for i in sorted(live):
                stream, token = self.streams[i], ids[i]
                self.token_ids[i].append(token)
                if token == eot:
                    stream.close("end_of_text")
                else:
                    stream.feed(decode_bytes([token]))
                    if last:
                        stream.close("length")
                if stream.done:
                    live.discard(i)
                    self.finished_at[i] = now
                    yield TextEvent(i, stream.take(), True)
                else:
                    piece = stream.take()
                    if piece:
                        yield TextEvent(i, piece, False)
            if not live:
                break
        steps.close()
        self.seconds = time.perf_counter() - t0

    @property
    def samples(self) -> list[SampleResult]:
        return [
            SampleResult(s.text, ids, s.finish_reason or "length", t)
            for s, ids, t in zip(self.streams, self.token_ids, self.finished_at, strict=True)
        ]

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of all samples per second, the prefill included."""
        total = sum(len(ids) for ids in self.token_ids)
        return total / self.seconds if self.seconds > 0 else 0.0


def generate(model: GPT, tokenizer: Tokenizer, prompt: str, **options: Any) -> list[SampleResult]:
    """Continue `prompt` (options as for `Generation`); returns one result per sample."""
    gen = Generation(model, tokenizer, encode_prompt(tokenizer, prompt), **options)
    for _ in gen.events():
        pass
    return gen.samples
