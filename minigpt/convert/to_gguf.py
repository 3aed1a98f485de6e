"""`minigpt convert to-gguf`: a run as one GGUF file that llama.cpp runs, written with ggml's own `gguf`
package (the optional `gguf` extra, imported only here) from the run's weights, without torch.

Which llama.cpp architecture follows from the model, as `hfmap.family_for` picks the Hugging Face class:
GPT-2's options run as llama.cpp's `gpt2`; rotary + RMSNorm + SwiGLU (any number of key/value heads, tied or
untied, with or without biases) as `llama`; add QK-norm (no biases) and it is `qwen3`. llama.cpp's llama
rotates each query/key head as interleaved pairs where minigpt (like transformers) rotates its two halves, so
the query and key rows of every head are reordered to match (the permutation llama.cpp's own converter
applies); qwen3 rotates halves, as minigpt does. Local attention (--window) runs in none of the three.

The tokenizer goes in as GGUF's byte-level BPE ("gpt2" model; minigpt.tokenizer.hf's tables) with the
pre-tokenizer llama.cpp has for its split pattern. A char tokenizer is a byte-level BPE whose merges build
each character from its bytes; it runs where llama.cpp's end-of-text rule allows (see `_special_ids`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minigpt.chat.template import END, ChatTemplate, has_chat_tokens
from minigpt.common.files import atomic_path
from minigpt.convert.config import ConvertResult, GGUFConfig, record_export
from minigpt.convert.hf_map import family_for, qkv_rows
from minigpt.corpus.progress import QUIET, Progress
from minigpt.errors import MinigptError
from minigpt.model.config import GPTConfig
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.base import Tokenizer
from minigpt.tokenizer.bpe import (
    CL100K_SPLIT_PATTERN,
    GPT2_SPLIT_PATTERN,
    GPT4_SPLIT_PATTERN,
    O200K_SPLIT_PATTERN,
    _RankedBPE,
)

if TYPE_CHECKING:
    import gguf

__all__ = ["gguf_architecture", "gguf_tensors", "to_gguf"]
# llama.cpp's pre-tokenizer (tokenizer.ggml.pre) that splits text as each known pattern does
_PRE_TOKENIZERS = {
    GPT2_SPLIT_PATTERN: "gpt-2",
    GPT4_SPLIT_PATTERN: "llama-bpe",  # cl100k's splits (and takes a piece that is a token whole, as tiktoken)
    CL100K_SPLIT_PATTERN: "llama-bpe",
    O200K_SPLIT_PATTERN: "gpt-4o",
}
# llama.cpp's BPE vocabulary ends generation at token 11 unless the file names another end-of-text token
_DEFAULT_EOS = 11
_INERT_MERGE = "\u0100\u0100 \u0100"
_ARCHITECTURES = {"gpt2": "gpt2", "llama": "llama", "qwen3": "qwen3"}
_LLAMA_TOP = {"transformer.wte": "token_embd", "transformer.ln_f": "output_norm", "lm_head": "output"}
_LLAMA_LAYER = {
    "ln_1": "attn_norm",
    "attn.c_proj": "attn_output",
    "attn.q_norm": "attn_q_norm",
    "attn.k_norm": "attn_k_norm",
    "ln_2": "ffn_norm",
    "mlp.c_gate": "ffn_gate",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_GPT2_TOP = {**_LLAMA_TOP, "transformer.wpe": "position_embd"}
_GPT2_LAYER = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def gguf_architecture(config: GPTConfig) -> str:
    """The llama.cpp architecture that runs this model, or a one-line error naming the option none has."""
    family = family_for(config, target="GGUF")
    if any(w < config.block_size for w in config.layer_windows):
        raise MinigptError(
            f"cannot export to GGUF: this model has --window {config.window}; llama.cpp's {family} has no "
            f"local attention (train without --window to export)"
        )
    return _ARCHITECTURES[family]


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise MinigptError(
            "minigpt convert to-gguf needs ggml's gguf package: pip install 'minigpt[gguf]' "
            "(pip install -e '.[gguf]' in a checkout)"
        ) from None
    return gguf


# ---------------------------------------------------------------- tensors


def _interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head reordered from rotate-halves (dims i and i + d/2 paired) to llama.cpp's
    interleaved pairs (dims 2i and 2i + 1): the layout its llama architecture rotates."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_tensors(
    config: GPTConfig, tensors: dict[str, np.ndarray], arch: str
) -> Iterator[tuple[str, np.ndarray]]:
    for name, t in tensors.items():
        module, kind = name.rsplit(".", 1)
        if not module.startswith("transformer.h."):
            yield f"{_LLAMA_TOP[module]}.{kind}", t
            continue
        i, part = module.removeprefix("transformer.h.").split(".", 1)
        if part != "attn.c_attn":
            yield f"blk.{i}.{_LLAMA_LAYER[part]}.{kind}", t
            continue
        q, k, v = np.split(t, np.cumsum(qkv_rows(config))[:2])
        if arch == "llama":
            q, k = _interleave_rotary(q, config.n_head), _interleave_rotary(k, config.kv_heads)
        yield from ((f"blk.{i}.attn_{p}.{kind}", x) for p, x in (("q", q), ("k", k), ("v", v)))


def _gpt2_tensors(tensors: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    for name, t in tensors.items():
        module, kind = name.rsplit(".", 1)
        if module.startswith("transformer.h."):
            i, part = module.removeprefix("transformer.h.").split(".", 1)
            yield f"blk.{i}.{_GPT2_LAYER[part]}.{kind}", t
        else:
            yield f"{_GPT2_TOP[module]}.{kind}", t


def gguf_tensors(config: GPTConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """minigpt's tensors (GPT-2 names, (out, in) layout) under llama.cpp's names, in its layout (float32)."""
    arch = gguf_architecture(config)
    pairs = _gpt2_tensors(tensors) if arch == "gpt2" else _llama_tensors(config, tensors, arch)
    return {name: np.ascontiguousarray(t, dtype=np.float32) for name, t in pairs}


def _stored(gguf: Any, t: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """A tensor as the file stores it: vectors (norms, biases) stay float32, as llama.cpp wants them;
    matrices in `dtype`, q8_0 where a row is whole blocks of 32 (float16 otherwise, as llama.cpp does)."""
    q = gguf.GGMLQuantizationType
    if t.ndim == 1 or dtype == "f32":
        return t, q.F32
    if dtype == "q8_0" and t.shape[-1] % 32 == 0:
        return gguf.quants.quantize(t, q.Q8_0), q.Q8_0
    return t.astype(np.float16), q.F16


# ---------------------------------------------------------------- metadata


def _hyperparameters(w: gguf.GGUFWriter, config: GPTConfig, arch: str) -> None:
    w.add_context_length(config.block_size)
    w.add_embedding_length(config.n_embd)
    w.add_block_count(config.n_layer)
    w.add_feed_forward_length(config.d_ff)
    w.add_head_count(config.n_head)
    w.add_vocab_size(config.vocab_size)
    if arch == "gpt2":
        w.add_layer_norm_eps(config.layer_norm_eps)
        return
    w.add_head_count_kv(config.kv_heads)
    w.add_layer_norm_rms_eps(config.layer_norm_eps)
    w.add_rope_freq_base(config.rope_base)
    w.add_rope_dimension_count(config.head_dim)


def _special_ids(tok: Tokenizer, kinds: list[str]) -> int | None:
    """The end-of-text id to name in the file: <|endoftext|>, else a chat run's <|end|>, else for a char
    tokenizer an id no character uses. llama.cpp's BPE vocabulary always has one (id 11 unless the file names another) and stops
    generating there, so a char model whose every id from 11 up is a character cannot run as itself."""
    if tok.eot_id is not None:
        return tok.eot_id
    if has_chat_tokens(tok):  # a char chat run: its answers end at <|end|>
        return tok.specials[END]
    unused = next((i for i, kind in enumerate(kinds) if kind == "unused"), None)
    if unused is None and len(kinds) > _DEFAULT_EOS:
        raise MinigptError(
            f"cannot export this char tokenizer to GGUF: llama.cpp's byte-level BPE vocabulary always has an "
            f"end-of-text token (id {_DEFAULT_EOS}, here {tok.decode([_DEFAULT_EOS])!r}, unless the file names "
            f"another) and stops generating at it, and all {len(kinds)} ids are characters; train with "
            f"--tokenizer bpe to export to llama.cpp"
        )
    return unused


def _tokenizer(w: gguf.GGUFWriter, gguf: Any, tok: Tokenizer, vocab_size: int) -> None:
    from minigpt.tokenizer.hf import byte_level_tables

    tables = byte_level_tables(tok, vocab_size)
    eos = _special_ids(tok, tables.kinds)
    types = {
        "normal": gguf.TokenType.NORMAL,
        "control": gguf.TokenType.CONTROL,
        "unused": gguf.TokenType.UNUSED,
    }
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_PRE_TOKENIZERS[tok.pattern] if isinstance(tok, _RankedBPE) else "default")
    w.add_token_list(tables.tokens)
    w.add_token_types([types[k] for k in tables.kinds])
    # llama.cpp requires merges and gguf writes no empty list: a char tokenizer of one-byte characters gets
    # one that never applies (its left part, two NUL bytes, is never made: nothing merges NUL with NUL)
    w.add_token_merges(tables.merges or [_INERT_MERGE])
    if eos is not None:
        w.add_bos_token_id(eos)
        w.add_eos_token_id(eos)
    w.add_add_bos_token(False)  # minigpt starts a text with nothing before it
    w.add_add_eos_token(False)
    if has_chat_tokens(tok):  # a chat run: its template (llama.cpp's --jinja runs it) and the end of a turn
        w.add_chat_template(ChatTemplate.jinja())
        w.add_eot_token_id(tok.specials[END])


# ---------------------------------------------------------------- the export


def to_gguf(
    run: Path,
    out: Path,
    settings: GGUFConfig = GGUFConfig(),
    *,
    overwrite: bool = False,
    progress: Progress = QUIET,
) -> ConvertResult:
    """Write the run's best weights and tokenizer as the GGUF file `out` (atomically), matrices in
    `settings.dtype`; an existing file is only replaced with `overwrite`. `progress` shows the loading,
    the tensors converted and the writing."""
    dtype = settings.dtype
    run, out = Path(run), Path(out)
    rundir = RunDir(run)
    _, config, tok = rundir.open()
    arch = gguf_architecture(config)
    _check_out(out, run, overwrite)
    gguf = _import_gguf()
    with progress.phase(f"loading {run}"):
        tensors = gguf_tensors(config, rundir.load_weights(config, framework="np"))
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(run.resolve().name)
        w.add_description(f"minigpt run {run.resolve().name}: {config.architecture}, {tok.describe()}")
        file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                      "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
        w.add_file_type(file_types[dtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _hyperparameters(w, config, arch)
        _tokenizer(w, gguf, tok, config.vocab_size)
        with progress.phase(f"converting the tensors to {dtype}", len(tensors), unit="tensors") as meter:
            for name, t in tensors.items():
                data, kind = _stored(gguf, t, dtype)
                w.add_tensor(name, data, raw_dtype=kind)  # a q8_0 shape is read from its bytes
                meter(1)
        with progress.phase(f"writing {out}"):
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
    params = sum(t.size for t in tensors.values())
    note = record_export(rundir, "gguf", out, architecture=arch, dtype=dtype)
    return ConvertResult(out, config, params, tok.describe(), note)


def _check_out(out: Path, run: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise MinigptError(f"{out} is a directory: give the GGUF file to write, e.g. {out / run.name}.gguf")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise MinigptError(f"{out} exists: choose another file or pass --overwrite to replace it")
