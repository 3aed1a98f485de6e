"""Backend-free generation: the context-window policy, sampling checks, streamed UTF-8 text, the driver.

Everything here is plain Python, so `minigpt generate` can run the NumPy engine without importing torch.
An engine (the torch one in `minigpt.sampling`, the NumPy one in `minigpt.numpy_engine`) turns a prompt
into the next token of every sample, step by step; `Generation` turns those tokens into text.

Context windowing (one policy, shared by both engines and the plain reference loop): a prompt longer than
block_size is cut to its last block_size tokens; the window then grows one token per step, and when it
would pass block_size its oldest `slide` tokens are dropped. Learned positions mean dropped tokens change
every remaining token's position, so a cached engine re-prefills the kept window in one forward pass;
with slide=1 this is exactly nanoGPT's crop-to-the-last-block_size loop (a re-prefill for every token),
with a larger slide one re-prefill serves `slide` tokens.
"""

from __future__ import annotations

import codecs
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from minigpt.errors import MinigptError, UsageError
from minigpt.files import safetensors_header
from minigpt.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minigpt.model import GPT

__all__ = [
    "BACKENDS",
    "Engine",
    "Generation",
    "SampleResult",
    "TextEvent",
    "TextStream",
    "accelerator_visible",
    "as_engine",
    "check_sampling",
    "choose_backend",
    "default_slide",
    "encode_prompt",
    "generate",
    "resolve_slide",
    "window_drop",
]


@runtime_checkable
class Engine(Protocol):
    """A model that continues token ids; what `Generation` drives."""

    block_size: int

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        num_samples: int,
        slide: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int,
    ) -> Iterator[list[int]]:
        """Yield the next token id of every sample, step by step: the prompt (its last block_size ids) is
        prefilled once and continued as num_samples rows. Same seed, same tokens; temperature 0 is greedy."""
        ...


def as_engine(model: Engine | GPT) -> Engine:
    """An engine as it is, or a torch GPT module wrapped in the KV-cache engine."""
    if isinstance(model, Engine):
        return model
    from minigpt.sampling import TorchEngine

    return TorchEngine(model)


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
        model: Engine | GPT,
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
        self.engine = as_engine(model)
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.slide = resolve_slide(slide, self.engine.block_size)
        self.streams = [TextStream(stop) for _ in range(num_samples)]
        self.token_ids: list[list[int]] = [[] for _ in range(num_samples)]
        self.finished_at = [0.0] * num_samples
        self.time_to_first_token = 0.0
        self.seconds = 0.0
        self.steps = 0

    def events(self) -> Iterator[TextEvent]:
        eot = self.tokenizer.eot_id
        decode_bytes = self.tokenizer.decode_bytes
        t0 = time.perf_counter()
        steps = self.engine.decode(
            self.prompt_ids, self.max_new_tokens, num_samples=self.num_samples, slide=self.slide,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
        )  # fmt: skip
        live = set(range(self.num_samples))
        for step, ids in enumerate(steps):
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


def generate(model: Engine | GPT, tokenizer: Tokenizer, prompt: str, **options: Any) -> list[SampleResult]:
    """Continue `prompt` (options as for `Generation`); returns one result per sample."""
    gen = Generation(model, tokenizer, encode_prompt(tokenizer, prompt), **options)
    for _ in gen.events():
        pass
    return gen.samples


# --- which engine -----------------------------------------------------------------------------------

BACKENDS = ("auto", "torch", "numpy")
NUMPY_DTYPES = ("F32", "F16", "F64")  # safetensors dtypes NumPy can hold; bf16 needs torch


def accelerator_visible() -> bool:
    """Whether torch may find a GPU here, judged without importing it: Apple silicon (MPS), or the device
    nodes of NVIDIA, AMD (ROCm) or WSL GPU drivers, unless CUDA_VISIBLE_DEVICES hides them all."""
    if sys.platform == "darwin":
        return platform.machine() == "arm64"
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def choose_backend(
    backend: str, device: str, dtype: str, *, explain: bool = False, weights: Path | None = None
) -> str:
    """'numpy' or 'torch' for `minigpt generate`. auto: NumPy for float32 on the CPU (no accelerator
    visible, or --device cpu), which starts in a fraction of a second; torch for GPUs, other dtypes,
    --explain (it reads torch's attention) and weights NumPy cannot hold."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    needs_torch = None
    if device in ("cuda", "mps"):
        needs_torch = f"--device {device}"
    elif dtype not in ("auto", "float32"):
        needs_torch = f"--dtype {dtype}"
    elif explain:
        needs_torch = "--explain"
    if backend == "numpy":
        if needs_torch:
            raise UsageError(
                f"--backend numpy runs float32 on the CPU: drop {needs_torch} or use --backend torch"
            )
        return "numpy"
    if needs_torch or (device == "auto" and accelerator_visible()):
        return "torch"
    if weights is not None and weights.is_file():
        try:
            dtypes = {v["dtype"] for v in safetensors_header(weights).values()}
        except MinigptError:
            return "numpy"  # its loader names the damage
        if not dtypes <= set(NUMPY_DTYPES):
            return "torch"
    return "numpy"
