"""Decoding, written once for every engine: the window policy, the token loop, streamed text, the driver.

Plain Python, so `minigpt generate` can run the NumPy engine without importing torch. An `Engine` (the
torch one in `minigpt.generate.engines.torch_engine`, the NumPy one in `minigpt.generate.engines.numpy_engine`) supplies a KV cache, a
forward pass to last-position logits and its sampling rules; `decode` turns a prompt into the next token
of every sample, step by step, and `Generation` turns those tokens into text.

Context windowing (one policy, for the cached loop and the plain reference loop alike): a prompt longer
than block_size is cut to its last block_size tokens; the window then grows one token per step, and when
it would pass block_size its oldest `slide` tokens are dropped. Learned positions mean dropped tokens
change every remaining token's position, so the cached loop re-prefills the kept window in one forward
pass; with slide=1 this is exactly nanoGPT's crop-to-the-last-block_size loop (a re-prefill for every
token), with a larger slide one re-prefill serves `slide` tokens. Rotary models never slide: attention
scores depend only on distances, so each layer's cache keeps the positions it attends to (block_size, or
its window) and drops the oldest, at constant cost per token however long the text.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TextIO

from minigpt.errors import MinigptError, UsageError
from minigpt.model.memory import allocating

if TYPE_CHECKING:
    import numpy as np

    from minigpt.model.kvcache import KVCache
    from minigpt.tokenizer.base import Tokenizer

__all__ = [
    "SAMPLE_SEPARATOR",
    "Engine",
    "Generation",
    "SampleResult",
    "Sampling",
    "TextEvent",
    "TextStream",
    "check_sampling",
    "decode",
    "default_slide",
    "encode_prompt",
    "generate",
    "generate_uncached",
    "resolve_slide",
    "window_drop",
    "write_text",
]

SAMPLE_SEPARATOR = "\n---------------\n"


class Engine(Protocol):
    """One backend's model, as the decode loop and the server drive it. Logits, caches and random
    generators are the backend's own types: callers only hand them back to the engine; `log_probs` turns
    logits into NumPy for what is shown to people."""

    name: str  # "torch" or "numpy"
    path: str  # which of the engine's ways of decoding runs: "kernels" or "array path" (numpy), "" (torch)
    device: str
    dtype: str
    quantize: str  # how the linear layers' weights are stored: "none" (in dtype) or "int8"
    kv_cache: str  # what the KV cache holds keys and values in: "float32", "float16", "bfloat16"
    block_size: int
    # rotary positions: cached keys carry no absolute position, so past block_size the cache drops its
    # oldest entries and decoding goes on; learned positions slide the window and re-read it instead
    rotary: bool

    @property
    def threads(self) -> int:
        """CPU threads the latest step ran on (minigpt.generate.engines.tuning chooses them)."""
        ...

    def new_cache(self, batch: int, capacity: int | None = None) -> KVCache[Any]:
        """An empty KV cache of `batch` rows, each layer holding at most `capacity` positions (None: as
        many as it attends to)."""
        ...

    def forward(
        self, ids: Sequence[Sequence[int]], cache: KVCache[Any] | None, *, every_position: bool = False
    ) -> Any:
        """Last-position logits (B, V) after feeding ids (B rows of T tokens) at the cache's positions (rows
        at different positions take one token each); without a cache, a full forward pass over ids. A
        1-row feed into an empty cache of B rows gives logits for all B.
        every_position: logits (B, T, V) of every fed position (scoring a prompt), the same pass."""
        ...

    def gather(self, parts: Sequence[tuple[KVCache[Any], int, int]]) -> KVCache[Any]:
        """A new cache of rows start:stop of each (cache, start, stop), in order, each row at its position."""
        ...

    def log_probs(self, logits: Any) -> np.ndarray:
        """float64 NumPy log-probabilities (log-softmax over the last axis) of this engine's logits."""
        ...

    def sample(
        self, logits: Any, temperature: float, top_k: int | None, top_p: float | None, rng: Any
    ) -> list[int]:
        """One token per row: temperature 0 is argmax (rng untouched); otherwise divide by the temperature,
        keep exactly the top_k largest, then the smallest set reaching top_p, and draw with rng."""
        ...

    def rng(self, seed: int) -> Any:
        """A random generator for `sample`: the same seed draws the same tokens on this backend."""
        ...


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


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject sampling settings that cannot work, with one-line messages."""
    if not temperature >= 0 or temperature == float("inf"):  # also catches NaN
        raise UsageError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"top-k must be at least 1 (1 is greedy), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"top-p must be in (0, 1] (1 keeps every token), got {top_p}")


# --- the token loops ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn, as `Engine.sample` takes it."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0


class _Windows:
    """Every row's context window: its prompt's last block_size ids (one prompt for all samples), then
    each new token, the oldest `slide` dropped whenever the window outgrows the block (never for a
    rotary model: its cache forgets what its layers no longer see)."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        block_size: int,
        slide: int | None,
        rotary: bool = False,
    ) -> None:
        if num_samples > 1 and len(prompts) != 1:
            raise UsageError(f"num_samples={num_samples} needs one prompt, got {len(prompts)}")
        if not prompts or not prompts[0] or len({len(p) for p in prompts}) != 1:
            raise UsageError("decoding needs prompts of one length, at least one token each")
        self.block_size = block_size
        self.slide = resolve_slide(slide, block_size)
        self.rotary = rotary
        self.prompts = [list(p)[-block_size:] for p in prompts]
        self.rows = [list(self.prompts[i % len(prompts)]) for i in range(max(len(prompts), num_samples))]

    def append(self, tokens: list[int]) -> bool:
        """Add each row's new token; True when the windows slid (dropped their oldest tokens)."""
        for row, token in zip(self.rows, tokens, strict=True):
            row.append(token)
        drop = 0 if self.rotary else window_drop(len(self.rows[0]), self.block_size, self.slide)
        if drop:
            for row in self.rows:
                del row[:drop]
        return drop > 0


def decode(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    sampling: Sampling = Sampling(),
) -> Iterator[list[int]]:
    """Yield the next token of every row, step by step: the prompts (one length) are prefilled in one
    forward pass, then each step feeds one token per row through the KV cache. Same tokens as
    `generate_uncached`.

    With num_samples > 1 there is one prompt: it is prefilled once, as a single row, and continued as
    num_samples rows. The next token is fed only when the caller asks for it, so stopping early wastes no
    forward pass.
    """
    windows = _Windows(prompts, num_samples, engine.block_size, slide, engine.rotary)
    rng = engine.rng(sampling.seed)
    with allocating(
        f"the KV cache and activations of {len(windows.rows):,} rows", fix="lower -s/--num-samples"
    ):
        # as many positions as this generation reaches, not block_size: a batch's cache at GPT-2's block is
        # 38 MB a row, and zeroing all of it cost a batch of 8 half a second before its first token
        cache = engine.new_cache(len(windows.rows), len(windows.prompts[0]) + max_new_tokens)
        logits = engine.forward(windows.prompts, cache)
        for step in range(max_new_tokens):
            tokens = engine.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, rng)
            yield tokens
            if step + 1 == max_new_tokens:
                return
            if windows.append(tokens):
                cache.reset()
                logits = engine.forward(windows.rows, cache)
            else:
                logits = engine.forward([[token] for token in tokens], cache)


def generate_uncached(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    slide: int | None = None,
    sampling: Sampling = Sampling(),
) -> list[list[int]]:
    """Reference loop: a full forward pass over every row's current window for every token, no cache.

    Returns what `decode` yields, step by step; tests and the benchmark hold the cached loop to it.
    """
    windows = _Windows(prompts, num_samples, engine.block_size, slide, engine.rotary)
    rng = engine.rng(sampling.seed)
    steps = []
    for _ in range(max_new_tokens):
        logits = engine.forward(windows.rows, None)
        steps.append(engine.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, rng))
        windows.append(steps[-1])
    return steps


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
    finish_reason: str  # "length", "stop" (a stop string) or "end_of_text" (<|endoftext|>, or a stop id)
    seconds: float  # from the start of the prefill until this sample finished

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class Generation:
    """One batched generation: every sample shares one prefill of the prompt.

    Iterate `events()` for the text as it becomes safe to show (or call `run()`), then read `samples` and
    the timings. `stop` strings end a sample and are not part of its text; so do the tokenizer's
    <|endoftext|> and the `stop_ids` given (a chat answer ends at a turn's control tokens).
    """

    def __init__(
        self,
        engine: Engine,
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
        stop_ids: Collection[int] = (),
    ) -> None:
        if max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be at least 1, got {max_new_tokens}")
        if num_samples < 1:
            raise UsageError(f"num-samples must be at least 1, got {num_samples}")
        if not prompt_ids:
            raise UsageError("the prompt has no tokens")
        check_sampling(temperature, top_k, top_p)
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.sampling = Sampling(temperature, top_k, top_p, seed)
        self.slide = resolve_slide(slide, engine.block_size)
        self.streams = [TextStream(stop) for _ in range(num_samples)]
        self.stop_ids = frozenset(stop_ids) | ({tokenizer.eot_id} if tokenizer.eot_id is not None else set())
        self.token_ids: list[list[int]] = [[] for _ in range(num_samples)]
        self.finished_at = [0.0] * num_samples
        self.time_to_first_token = 0.0
        self.seconds = 0.0
        self.steps = 0

    def events(self) -> Iterator[TextEvent]:
        t0 = time.perf_counter()
        steps = decode(
            self.engine, [self.prompt_ids], self.max_new_tokens, num_samples=self.num_samples,
            slide=self.slide, sampling=self.sampling,
        )  # fmt: skip
        live = set(range(self.num_samples))
        for step, ids in enumerate(steps):
            now = time.perf_counter() - t0
            if step == 0:
                self.time_to_first_token = now
            self.steps = step + 1
            for i in sorted(live):
                self.token_ids[i].append(ids[i])
                piece, done = self._feed(self.streams[i], ids[i], step + 1 == self.max_new_tokens)
                if done:
                    live.discard(i)
                    self.finished_at[i] = now
                if piece or done:
                    yield TextEvent(i, piece, done)
            if not live:
                break
        steps.close()
        self.seconds = time.perf_counter() - t0

    def _feed(self, stream: TextStream, token: int, last: bool) -> tuple[str, bool]:
        """Give a sample's stream its next token: the text now safe to show, and whether it is done."""
        if token in self.stop_ids:
            stream.close("end_of_text")
        else:
            stream.feed(self.tokenizer.decode_bytes([token]))
            if last:
                stream.close("length")
        return stream.take(), stream.done

    def run(self) -> list[SampleResult]:
        """Generate every sample to its end, showing nothing."""
        for _ in self.events():
            pass
        return self.samples

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

    def to_json(self) -> dict[str, Any]:
        """Settings, timings and each sample's text and counts, the object `minigpt generate --json` prints."""
        return {
            "prompt_tokens": len(self.prompt_ids),
            "seed": None if self.sampling.temperature == 0 else self.sampling.seed,
            "temperature": self.sampling.temperature,
            "top_k": self.sampling.top_k,
            "top_p": self.sampling.top_p,
            "backend": self.engine.name,
            "path": self.engine.path or None,
            "device": self.engine.device,
            "dtype": self.engine.dtype,
            "quantize": self.engine.quantize,
            "kv_cache": self.engine.kv_cache,
            "threads": self.engine.threads if self.engine.device == "cpu" else None,
            "time_to_first_token_s": round(self.time_to_first_token, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "samples": [
                {
                    "text": s.text,
                    "completion_tokens": len(s.token_ids),
                    "tokens_per_second": round(s.tokens_per_second, 2),
                    "finish_reason": s.finish_reason,
                }
                for s in self.samples
            ],
        }

    def summary(self, loaded: float | None = None) -> str:
        """One line: tokens, time (from the prompt's prefill to the last token), speed, time to the first
        token, the engine and the path it decoded on, the seed (greedy needs none), and the seconds the
        engine took to load, where given (`loaded`)."""
        total = sum(len(ids) for ids in self.token_ids)
        seed = "greedy" if self.sampling.temperature == 0 else f"seed {self.sampling.seed}"
        quantized = "" if self.engine.quantize == "none" else f", {self.engine.quantize} weights"
        threads = self.engine.threads
        on_cpu = f", {threads} thread{'s' * (threads > 1)}" if self.engine.device == "cpu" else ""
        engine = " ".join(filter(None, [self.engine.name, self.engine.path]))
        load = "" if loaded is None else f", load {loaded:.2f} s"
        return (
            f"{total:,} tokens in {self.seconds:.2f} s ({self.tokens_per_second:,.1f} tokens/s, first after "
            f"{self.time_to_first_token * 1000:.0f} ms{load}, {engine} on {self.engine.device}{on_cpu}"
            f"{quantized}), {seed}"
        )


def generate(engine: Engine, tokenizer: Tokenizer, prompt: str, **options: Any) -> list[SampleResult]:
    """Continue `prompt` (options as for `Generation`); returns one result per sample."""
    return Generation(engine, tokenizer, encode_prompt(tokenizer, prompt), **options).run()


def write_text(gen: Generation, out: TextIO, stream: bool) -> None:
    """Run `gen`, writing its samples to `out` one after another, SAMPLE_SEPARATOR between them.

    Streaming, sample 0 is written as it is generated; later samples, generated alongside it, wait in a
    buffer until every sample before them is done. Otherwise all is written at the end. Either way `out`
    receives the same text, and a terminal gets a final newline to keep the shell prompt off it.
    """
    shown = 0  # the sample being streamed
    pending = [""] * gen.num_samples
    finished = [False] * gen.num_samples
    for event in gen.events():
        if not stream:
            continue
        if event.sample == shown:
            out.write(event.text)
        else:
            pending[event.sample] += event.text
        finished[event.sample] |= event.done
        while shown < gen.num_samples and finished[shown]:
            shown += 1
            if shown < gen.num_samples:
                out.write(SAMPLE_SEPARATOR + pending[shown])
        out.flush()
    if not stream:
        out.write(SAMPLE_SEPARATOR.join(s.text for s in gen.samples))
    if out.isatty():
        out.write("\n")
    out.flush()
