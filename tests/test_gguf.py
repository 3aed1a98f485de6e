"""`minigpt convert to-gguf` against ggml's own gguf reader: names, shapes, values, hyperparameters and the
tokenizer, whose tables a byte-level BPE written here (llama.cpp's algorithm) holds to minigpt's ids."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import regex
import torch

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install -e '.[gguf]'")

from conftest import CORPUS, MIXED, R50K_FILE  # noqa: E402

from minigpt.cli.main import app  # noqa: E402
from minigpt.model.build import model_tensors  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.tokenizer.base import Tokenizer  # noqa: E402
from minigpt.tokenizer.bpe import GPT2_SPLIT_PATTERN, BPETokenizer, TiktokenTokenizer  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402
from minigpt.tokenizer.hf import bytes_to_unicode  # noqa: E402

torch.set_num_threads(1)

ROTARY = dict(pos="rope", norm="rmsnorm", mlp="swiglu")
SHAPE = dict(block_size=32, n_layer=2, n_head=4, n_embd=64)


def one_line_error(result: Any) -> str:
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def save_run(path: Path, tok: Tokenizer, vocab_size: int | None = None, **options: Any) -> GPT:
    """A run whose every tensor is random (gains and biases too), so a misplaced one shows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size or tok.vocab_size, **{**SHAPE, **options}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    RunDir(path).save(model, tok, {})
    return model


def read(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, np.ndarray]]]:
    """A GGUF file's metadata and its tensors (type name, float32 values in numpy's row-major shape)."""
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        tensors[t.name] = (t.tensor_type.name, values.reshape([int(n) for n in reversed(t.shape)]))
    return fields, tensors


def interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's llama rotates pairs (2i, 2i + 1) of each head where minigpt rotates (i, i + d/2): row
    h*d + 2i of the file is minigpt's row h*d + i, and row h*d + 2i + 1 is h*d + d/2 + i."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def expected_tensors(model: GPT, arch: str) -> dict[str, np.ndarray]:
    """What each GGUF tensor must hold, from minigpt's own tensors (written out by hand here)."""
    c = model.config
    t = {k: v.numpy() for k, v in model_tensors(model).items()}
    top = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
           "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
           "lm_head.weight": "output.weight"}  # fmt: skip
    out = {gname: t[name] for name, gname in top.items() if name in t}
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            if arch == "gpt2":
                parts = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                         "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # fmt: skip
            else:
                parts = {"ln_1": "attn_norm", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                         "mlp.c_gate": "ffn_gate", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
                         "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm"}  # fmt: skip
                if f"{p}attn.c_attn.{kind}" in t:
                    qkv = t[f"{p}attn.c_attn.{kind}"]
                    q, k, v = np.split(qkv, [c.n_embd, c.n_embd + c.kv_heads * c.head_dim])
                    if arch == "llama":
                        q, k = interleaved(q, c.n_head), interleaved(k, c.kv_heads)
                    out.update(
                        {
                            f"blk.{i}.attn_q.{kind}": q,
                            f"blk.{i}.attn_k.{kind}": k,
                            f"blk.{i}.attn_v.{kind}": v,
                        }
                    )
            out.update(
                {
                    f"blk.{i}.{g}.{kind}": t[f"{p}{m}.{kind}"]
                    for m, g in parts.items()
                    if f"{p}{m}.{kind}" in t
                }
            )
    return out


def gguf_encode(fields: dict[str, Any], pattern: str | None, text: str) -> list[int]:
    """Token ids of `text` under the file's tokenizer, by llama.cpp's byte-level BPE: split by the pattern,
    map bytes to GPT-2's characters, take a piece that is a token whole (llama-bpe), else merge the
    lowest-ranked adjacent pair (leftmost first) until none applies, then look each piece up."""
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
    whole = fields["tokenizer.ggml.pre"] == "llama-bpe"
    to_chars = bytes_to_unicode()
    ids = []
    for piece in regex.findall(pattern, text) if pattern else [text]:
        word = "".join(to_chars[b] for b in piece.encode("utf-8"))
        if whole and word in vocab:
            ids.append(vocab[word])
            continue
        symbols = list(word)
        while True:
            pairs = [
                (ranks.get(pair, len(ranks)), i)
                for i, pair in enumerate(zip(symbols[:-1], symbols[1:], strict=True))
            ]
            rank, i = min(pairs, default=(len(ranks), -1))
            if rank == len(ranks):
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        ids += [vocab[s] for s in symbols]
    return ids


def export(runner: Any, run: Path, out: Path, *options: str) -> None:
    result = runner.invoke(app, ["convert", "to-gguf", str(run), str(out), *options])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr and "note:" not in result.stderr


CASES = {
    "llama (the default modern arch, biases)": ("llama", dict(**ROTARY, tie_embeddings=False)),
    "llama, grouped-query, tied, no biases": ("llama", dict(**ROTARY, n_kv_head=2, bias=False)),
    "qwen3 (QK-norm)": ("qwen3", dict(**ROTARY, qk_norm=True, bias=False, n_kv_head=1, tie_embeddings=False)),
    "gpt2": ("gpt2", dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_holds_the_model(case: str, tmp_path: Path, runner) -> None:
    arch, options = CASES[case]
    tok = BPETokenizer.train([CORPUS], 300)
    model = save_run(tmp_path / "run", tok, **options)
    export(runner, tmp_path / "run", tmp_path / "m.gguf")
    fields, tensors = read(tmp_path / "m.gguf")
    c = model.config
    assert fields["general.architecture"] == arch and fields["general.file_type"] == 0
    assert fields[f"{arch}.context_length"] == 32 and fields[f"{arch}.block_count"] == 2
    assert fields[f"{arch}.embedding_length"] == 64 and fields[f"{arch}.feed_forward_length"] == c.d_ff
    assert fields[f"{arch}.attention.head_count"] == 4
    if arch == "gpt2":
        assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(c.layer_norm_eps)
    else:
        assert fields[f"{arch}.attention.head_count_kv"] == c.kv_heads
        assert (
            fields[f"{arch}.rope.freq_base"] == c.rope_base and fields[f"{arch}.rope.dimension_count"] == 16
        )
    expected = expected_tensors(model, arch)
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        kind, values = tensors[name]
        assert kind == "F32" and values.shape == want.shape, name
        np.testing.assert_array_equal(values, want, err_msg=name)
    assert RunDir(tmp_path / "run").exports()[-1]["format"] == "gguf"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_smaller_dtypes(dtype: str, tmp_path: Path, runner) -> None:
    """Matrices in f16 or q8_0 (q8_0 where a row is whole blocks of 32, f16 otherwise); vectors float32."""
    tok = BPETokenizer.train([CORPUS], 300)
    model = save_run(tmp_path / "run", tok, **ROTARY, mlp_width=48)  # 48-wide rows: no whole q8_0 blocks
    export(runner, tmp_path / "run", tmp_path / "m.gguf", "--dtype", dtype)
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.file_type"] == {"f16": 1, "q8_0": 7}[dtype]
    for name, want in expected_tensors(model, "llama").items():
        kind, values = tensors[name]
        if want.ndim == 1:
            assert kind == "F32" and np.array_equal(values, want), name
        elif dtype == "f16" or want.shape[-1] % 32:
            assert kind == "F16" and np.array_equal(values, want.astype(np.float16).astype(np.float32)), name
        else:  # 8 bits per value and one float16 scale per 32: half a step, plus 127 steps' f16 rounding
            assert kind == "Q8_0", name
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(1, keepdims=True) / 127
            assert (np.abs(values.reshape(-1, 32) - blocks) <= step * (0.5 + 127 * 2.0**-11)).all(), name


def _tokenizers() -> dict[str, tuple[Tokenizer, str | None]]:
    toks: dict[str, tuple[Tokenizer, str | None]] = {
        "bpe-300": (BPETokenizer.train([CORPUS], 300), "llama-bpe"),
        "bpe-1024": (BPETokenizer.train([CORPUS], 1024), "llama-bpe"),
        "bpe, GPT-2's pattern": (BPETokenizer.train([CORPUS], 400, pattern=GPT2_SPLIT_PATTERN), "gpt-2"),
    }
    if R50K_FILE.is_file():
        toks["r50k"] = (TiktokenTokenizer.from_file(R50K_FILE), "gpt-2")
    return toks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bpe-300", "bpe-1024", "bpe, GPT-2's pattern", "r50k"])
def test_tokenizer_metadata(kind: str, tmp_path: Path, runner) -> None:
    toks = _tokenizers()
    if kind not in toks:
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    tok, pre = toks[kind]
    save_run(tmp_path / "run", tok, **(ROTARY if kind.startswith("bpe-") else {}))
    export(runner, tmp_path / "run", tmp_path / "m.gguf")
    fields, _ = read(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == pre
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == tok.vocab_size == len(set(tokens))
    assert tokens[tok.eot_id] == "<|endoftext|>" and types[tok.eot_id] == 3  # control
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.bos_token_id"] == tok.eot_id
    assert fields["tokenizer.ggml.add_bos_token"] is False
    to_chars = bytes_to_unicode()
    for i in range(0, tok.vocab_size, max(1, tok.vocab_size // 500)):
        if i != tok.eot_id:
            assert tokens[i] == "".join(to_chars[b] for b in tok.decode_bytes([i])) and types[i] == 1
    for text in (MIXED, MIXED[::-1], "hello  world\n\n  x"):
        assert gguf_encode(fields, tok.pattern, text) == tok.encode(text), kind


def test_a_char_tokenizer_with_a_spare_id(tmp_path: Path, runner) -> None:
    """A char tokenizer is a byte-level BPE whose merges build each character from its bytes; its
    end-of-text token is an id no character uses."""
    tok = CharTokenizer.from_text(CORPUS)
    save_run(tmp_path / "run", tok, vocab_size=tok.vocab_size + 1, **ROTARY)
    export(runner, tmp_path / "run", tmp_path / "m.gguf")
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.pre"] == "default"
    assert fields["tokenizer.ggml.eos_token_id"] == tok.vocab_size
    assert fields["tokenizer.ggml.token_type"][tok.vocab_size] == 5  # unused
    assert tensors["token_embd.weight"][1].shape == (tok.vocab_size + 1, 64)
    assert gguf_encode(fields, None, MIXED) == tok.encode(MIXED)


@pytest.mark.slow
def test_what_llama_cpp_cannot_run_is_a_one_line_error(tmp_path: Path, runner, monkeypatch) -> None:
    tok = CharTokenizer.from_text(CORPUS)
    cases = {
        "qk-norm with biases": (dict(**ROTARY, qk_norm=True, bias=True), "biases (--bias)"),
        "window": (dict(**ROTARY, qk_norm=True, bias=False, window=8), "--window 8"),
        "llama window": (dict(**ROTARY, window=8), "--window 8"),
        "relu2": (dict(pos="rope", norm="rmsnorm", mlp="relu2"), "--mlp relu2"),
        "additive score": (dict(**ROTARY, attn_score="additive"), "--attn-score additive"),
        "value embeddings": (dict(**ROTARY, value_embeds=True), "--value-embeds"),
        "skips": (dict(**ROTARY, skips=True), "--skips"),
        "logit cap": (dict(**ROTARY, logit_cap=30.0), "--logit-cap 30.0"),
        "char": (dict(**ROTARY), f"all {tok.vocab_size} ids are characters"),
    }
    for name, (options, message) in cases.items():
        run = tmp_path / name
        save_run(run, tok, **options)
        line = one_line_error(runner.invoke(app, ["convert", "to-gguf", str(run), str(tmp_path / "m.gguf")]))
        assert message in line and ("GGUF" in line or "llama.cpp" in line), line
        assert not (tmp_path / "m.gguf").exists()
    run = tmp_path / "ok"
    save_run(run, BPETokenizer.train([CORPUS], 300), **ROTARY)
    export(runner, run, tmp_path / "m.gguf")
    assert "--overwrite" in one_line_error(
        runner.invoke(app, ["convert", "to-gguf", str(run), str(tmp_path / "m.gguf")])
    )
    assert "directory" in one_line_error(runner.invoke(app, ["convert", "to-gguf", str(run), str(tmp_path)]))
    assert (
        runner.invoke(
            app, ["convert", "to-gguf", str(run), str(tmp_path / "m.gguf"), "--dtype", "q4"]
        ).exit_code
        == 2
    )
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the extra were not installed
    line = one_line_error(runner.invoke(app, ["convert", "to-gguf", str(run), str(tmp_path / "n.gguf")]))
    assert "pip install 'minigpt[gguf]'" in line


@pytest.mark.slow
def test_default_run_exports_and_is_listed(default_run: Path, tmp_path: Path, runner) -> None:
    """A run made with every default exports (llama, with biases), and `minigpt runs` says where to."""
    run = tmp_path / "runs" / "default"
    shutil.copytree(default_run, run)
    export(runner, run, tmp_path / "default.gguf", "--dtype", "q8_0")
    fields, _ = read(tmp_path / "default.gguf")
    assert fields["general.architecture"] == "llama" and fields["tokenizer.ggml.pre"] == "llama-bpe"
    assert runner.invoke(app, ["convert", "to-hf", str(run), str(tmp_path / "hf")]).exit_code == 0
    result = runner.invoke(app, ["runs", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["exports"] == ["gguf", "hf"]
