"""What `minigpt generate` draws from a model, which engine runs it (each field an option of `generate`,
the engine's of `serve` too), the prompt it continues and how it shows the text, all checked before any model
loads; no torch."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minigpt.common.device import DEVICES, DTYPES
from minigpt.common.settings import setting
from minigpt.errors import MinigptError, UsageError
from minigpt.model.weights import QUANTIZATIONS

SEED_MAX = 2**63 - 1  # torch and NumPy both take seeds in 0..2**63-1
BACKENDS = ("auto", "torch", "numpy")
KV_CACHES = ("auto", "float32", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs a model, on what and in which precision."""

    backend: str = setting(
        "auto", "Engine: numpy runs float32 on the CPU without importing torch (starts in a fraction of a "
        "second); torch runs on any device and dtype. auto: numpy on the CPU in float32, else torch.",
        choices=BACKENDS,
    )  # fmt: skip
    device: str = setting("auto", "Where to run: auto picks CUDA, then MPS, then the CPU.", choices=DEVICES)
    dtype: str = setting(
        "auto", "Weights' type (and the KV cache's on torch, unless --kv-cache says otherwise): auto is bfloat16 "
        "on CUDA, float16 on MPS, float32 on the CPU.",
        choices=DTYPES,
    )  # fmt: skip
    quantize: str = setting(
        "none", "Linear layers' weights: int8 reads a quarter of float32's bytes per token (CPU: generate and "
        "chat run it on the NumPy engine's kernels, eval and --backend torch on torch's; per-channel scales, "
        "activations stay in --dtype).",
        choices=QUANTIZATIONS,
    )  # fmt: skip
    kv_cache: str = setting(
        "auto", "What the KV cache holds keys and values in: float16 halves its memory and what each step reads "
        "of it (as llama.cpp does; values past float16's 65,504 are clamped). auto: float16 on the NumPy "
        "engine, --dtype on torch.",
        choices=KV_CACHES,
    )  # fmt: skip


@dataclass(frozen=True)
class GenerateConfig:
    """How many tokens, how many samples and how each next token is drawn."""

    max_new_tokens: int = setting(200, "Tokens to generate per sample.", flags=("--max-new-tokens", "-n"))
    temperature: float = setting(
        0.8, "Divide the logits by this; 0 is greedy (and ignores --seed).", flags=("--temperature", "-t")
    )
    top_k: int | None = setting(None, "Sample only from the k most likely tokens.")
    top_p: float | None = setting(
        None,
        "Nucleus sampling: the smallest set of tokens with this much probability (0 < p <= 1), after --top-k.",
    )
    seed: int | None = setting(
        None, "Random seed: the same seed gives the same text (default: a random one, shown; unused at -t 0)."
    )
    num_samples: int = setting(
        1,
        "Samples drawn as one batch from one prefill, printed one after another.",
        flags=("--num-samples", "-s"),
    )
    stop: list[str] | None = setting(
        None, "End a sample at this string, which is not printed (repeatable).", metavar="STRING"
    )
    slide: int | None = setting(
        None, "Context window policy past block_size: when the window is full, drop its oldest SLIDE tokens and "
        "re-read the rest in one pass (1 = always the last block_size tokens, as nanoGPT; larger = faster, "
        "shorter context right after a slide). Default: block_size // 4.",
    )  # fmt: skip

    def __post_init__(self) -> None:
        from minigpt.generate.decode import TextStream, check_sampling

        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--num-samples", self.num_samples),
                            ("--slide", self.slide)):  # fmt: skip
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1, got {value}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise UsageError(f"--seed must be in 0..2**63-1, got {self.seed}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        TextStream(self.stop or [])  # rejects an empty stop string

    def generation(self, seed: int) -> dict[str, Any]:
        """`decode.Generation`'s keyword arguments, with `seed` where none was given."""
        return {
            **asdict(self),
            "stop": list(self.stop or []),
            "seed": seed if self.seed is None else self.seed,
        }


@dataclass(frozen=True)
class GenerateIOConfig:
    """Where `minigpt generate` reads its prompt, and how it shows what it generates."""

    prompt_file: Path | None = setting(None, "Read the prompt from this UTF-8 file.")
    stream: bool | None = setting(
        None, "Print text as it is generated, whole characters at a time (default: when stdout is a terminal).",
        flags=("--stream/--no-stream",),
    )  # fmt: skip
    explain: bool = setting(
        False, "After generating, show for each new token which earlier tokens the last layer's heads weighted "
        "most (on stderr).", flags=("--explain",),
    )  # fmt: skip


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from the argument, --prompt-file, or standard input ('-')."""
    if prompt is not None and prompt_file is not None:
        raise MinigptError(
            "give the prompt either as an argument or with --prompt-file, not both", exit_code=2
        )
    if prompt_file is not None:
        if not prompt_file.is_file():
            what = "is a directory" if prompt_file.is_dir() else "does not exist"
            raise MinigptError(f"--prompt-file {prompt_file} {what}: pass a UTF-8 text file", exit_code=2)
        data, source = prompt_file.read_bytes(), str(prompt_file)
    elif prompt == "-":
        if sys.stdin.isatty():
            print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
        stdin = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
        data, source = (stdin.read() if stdin else sys.stdin.read().encode("utf-8")), "standard input"
    else:
        return prompt or ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinigptError(
            f"the prompt from {source} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
