"""Named model shapes: published GPT-2/GPT-3 sizes and small CPU-friendly ones, as plain data."""

from __future__ import annotations

from typing import Any

from minigpt.errors import UsageError
from minigpt.model.config import ARCHS, GPTConfig

GPT2_VOCAB = 50257

# Each preset lists the GPTConfig fields it fixes. Small presets leave vocab_size out: it comes
# from the tokenizer when training (and defaults to GPT-2's 50,257 when only counting).
PRESETS: dict[str, dict[str, Any]] = {
    # CPU-friendly shapes for tests, the demo and laptops
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
    # minigpt's default on CPU, the CPU recipe's shape
    "nano": dict(n_layer=2, n_head=4, n_embd=128, block_size=128),
    "mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    # GPT-2 (Radford et al. 2019), as released: n_ctx 1024, vocab 50,257, biases, tied head
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=GPT2_VOCAB),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=GPT2_VOCAB),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=GPT2_VOCAB),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024, vocab_size=GPT2_VOCAB),
    # GPT-3 (Brown et al. 2020, Table 2.1): n_ctx 2048, vocab 50,257, d_ff = 4 d_model
    "gpt3-small": dict(n_layer=12, n_head=12, n_embd=768, block_size=2048, vocab_size=GPT2_VOCAB),
    "gpt3-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048, vocab_size=GPT2_VOCAB),
    "gpt3-large": dict(n_layer=24, n_head=16, n_embd=1536, block_size=2048, vocab_size=GPT2_VOCAB),
    # Table 2.1 gives XL 24 heads of 128 with d_model 2048, but 24 x 128 = 3072; we keep d_model 2048
    # and head size 128, so 16 heads.
    "gpt3-xl": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=GPT2_VOCAB),
    "gpt3-2.7b": dict(n_layer=32, n_head=32, n_embd=2560, block_size=2048, vocab_size=GPT2_VOCAB),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=GPT2_VOCAB),
    # Table 2.1 prints d_model 5140 for 13B, but 40 heads x 128 = 5120, which we use
    "gpt3-13b": dict(n_layer=40, n_head=40, n_embd=5120, block_size=2048, vocab_size=GPT2_VOCAB),
    "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=GPT2_VOCAB),
}


def preset(name: str) -> dict[str, Any]:
    """The fields a named preset fixes (a copy), or an error listing the known names."""
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def model_config(preset_name: str | None = None, arch: str | None = None, **fields: Any) -> GPTConfig:
    """The model a preset's shape and an architecture's choices make, with GPTConfig fields given on their
    own over both (None: not given); without a preset GPTConfig's own shape, without an arch its own
    choices (GPT-2's), without a vocab_size GPT-2's: how `train` builds its model and `params` counts one."""
    if arch is not None and arch not in ARCHS:
        raise UsageError(f"unknown arch {arch!r}: choose {' or '.join(ARCHS)}")
    shape = preset(preset_name) if preset_name else {}
    given = {k: v for k, v in fields.items() if v is not None}
    chosen = {**(ARCHS[arch] if arch else {}), **given}
    if chosen.get("qk_norm") and "bias" not in given:
        # QK-norm takes Qwen3's layout, which has no biases: so a --qk-norm run exports to Qwen3ForCausalLM
        # and llama.cpp's qwen3 (an explicit --bias keeps them, and then has no Hugging Face class)
        chosen["bias"] = False
    return GPTConfig(**{"vocab_size": GPT2_VOCAB, **shape, **chosen})
