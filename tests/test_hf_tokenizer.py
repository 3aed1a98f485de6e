"""Hugging Face tokenizer files for every minigpt tokenizer, checked against transformers and `tokenizers`
themselves: the same ids on held-out mixed-script text for every export layout, read back by from-hf (also
after save_pretrained), AutoTokenizer on a run folder, and transformers' pipeline on a default-settings run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test-only dependency (the dev extra)

from conftest import CORPUS, MIXED, R50K_FILE, slow_but  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from minigpt.cli.main import app  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.tokenizer.base import Tokenizer  # noqa: E402
from minigpt.tokenizer.bpe import BPETokenizer, TiktokenTokenizer  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402
from minigpt.tokenizer.hf import tokenizer_from_hf_json, tokenizer_json  # noqa: E402

torch.set_num_threads(1)

LAYOUTS = {
    "GPT2LMHeadModel": dict(),
    "LlamaForCausalLM": dict(pos="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
    "Qwen3ForCausalLM": dict(pos="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=False),
}
HELD_OUT = [MIXED, MIXED[::-1], " leading space", "x", "\n\n\n", "trailing  \n  ", "tabs\t\t\tand  spaces"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    """Every kind minigpt trains or uses: bpe at two vocabulary sizes, char, and GPT-2's r50k_base."""
    toks: dict[str, Tokenizer] = {
        "bpe-300": BPETokenizer.train([CORPUS], 300),
        "bpe-1024": BPETokenizer.train([CORPUS], 1024),
        "char": CharTokenizer.from_text(CORPUS),
    }
    if R50K_FILE.is_file():
        toks["r50k"] = TiktokenTokenizer.from_file(R50K_FILE)
    return toks


def save_run(path: Path, tok: Tokenizer, layout: dict[str, Any]) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16, **layout))
    RunDir(path).save(model, tok, {})
    return model


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["bpe-300", "char", *slow_but(["bpe-1024", "r50k"])])
def test_autotokenizer_ids_equal_minigpts(
    kind: str, layout: str, tokenizers: dict[str, Tokenizer], tmp_path: Path, runner
) -> None:
    if kind not in tokenizers:
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    tok = tokenizers[kind]
    save_run(tmp_path / "run", tok, LAYOUTS[layout])
    result = runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [layout]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.is_fast and hf.model_max_length == 32
    for text in HELD_OUT:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids, (kind, text)
        assert hf.decode(ids) == text
    assert hf(HELD_OUT[:3])["input_ids"] == [tok.encode(t) for t in HELD_OUT[:3]]  # a batch too
    assert hf.eos_token_id == tok.eot_id and hf.bos_token_id == tok.eot_id


@pytest.mark.slow
def test_tokenizers_library_reads_what_minigpt_writes(tokenizers: dict[str, Tokenizer]) -> None:
    """The `tokenizers` library (transformers' backend) on the bare tokenizer.json, and minigpt's reader on
    it: both give back the tokenizer."""
    for kind, tok in tokenizers.items():
        data = tokenizer_json(tok)
        fast = HFTokenizer.from_str(json.dumps(data))
        fast.encode_special_tokens = True  # what tokenizer_config.json's split_special_tokens sets
        assert fast.encode(MIXED, add_special_tokens=False).ids == tok.encode(MIXED), kind
        back = tokenizer_from_hf_json(json.loads(json.dumps(data)), "tokenizer.json")
        assert type(back) is type(tok) and back.to_json() == tok.to_json(), kind
        assert back.describe() == tok.describe()


@pytest.mark.parametrize("kind", ["bpe-300", "char", pytest.param("r50k", marks=pytest.mark.slow)])
def test_from_hf_reads_what_save_pretrained_writes(
    kind: str, tokenizers: dict[str, Tokenizer], tmp_path: Path, runner
) -> None:
    """Export, load and save with transformers (which rewrites tokenizer.json and config.json its own
    way), import: the same config, weights and tokenizer."""
    if kind not in tokenizers:
        pytest.skip("../shared/data/r50k_base.tiktoken is absent")
    tok = tokenizers[kind]
    layout = LAYOUTS["GPT2LMHeadModel" if kind == "r50k" else "LlamaForCausalLM"]
    ours = save_run(tmp_path / "run", tok, layout)
    assert (
        runner.invoke(app, ["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]).exit_code == 0
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    resaved = tmp_path / "resaved"
    model.save_pretrained(resaved)
    hf_tok.save_pretrained(resaved)
    assert "minigpt" not in json.loads((resaved / "tokenizer.json").read_text())["model"]  # transformers' own
    result = runner.invoke(app, ["convert", "from-hf", str(resaved), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    again, tok2, _ = RunDir(tmp_path / "back").load_model()
    assert again.config == ours.config
    assert type(tok2) is type(tok) and tok2.to_json() == tok.to_json()  # bpe, char, r50k_base: recognised
    state = again.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())


@pytest.mark.slow
def test_autotokenizer_on_a_run_folder(default_run: Path) -> None:
    """A run folder's tokenizer.json is the Hugging Face file (with minigpt's kind inside its model), and
    tokenizer_config.json sits beside it: AutoTokenizer reads the run as it is."""
    tok = RunDir(default_run).tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(default_run)
    assert hf.is_fast and hf(MIXED)["input_ids"] == tok.encode(MIXED)
    assert (default_run / "README.md").read_text().startswith("---\n")


@pytest.mark.slow
def test_pipeline_greedy_text_of_a_default_run(default_run: Path, tmp_path: Path, runner) -> None:
    """transformers' text-generation pipeline on the export of a run made with every default gives the
    greedy text `minigpt generate` gives."""
    out = tmp_path / "hf"
    result = runner.invoke(app, ["convert", "to-hf", str(default_run), str(out)])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.stderr
    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    for prompt in ("alpha the quick", "你好 the", "def square"):
        theirs = generate(prompt, max_new_tokens=30, do_sample=False)[0]["generated_text"]
        ours = runner.invoke(app, ["generate", "--model", str(default_run), "-n", "30", "-t", "0", prompt])
        assert ours.exit_code == 0, ours.output
        assert theirs == prompt + ours.stdout, prompt


def _set_pattern(data: dict[str, Any]) -> None:
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a+)+$"


def _set_first(data: dict[str, Any], text: str, i: int) -> None:
    vocab = data["model"]["vocab"]
    first = next(iter(vocab))
    del vocab[first]
    vocab[text] = i


DAMAGE = {
    "a regex of its own": (_set_pattern, "not a byte-level split minigpt knows"),
    "an id past any vocabulary": (lambda d: _set_first(d, "Ā", 10**12), "token id 1000000000000"),
    "a token that is not bytes": (lambda d: _set_first(d, "ж", 0), "'ж' is not a byte-level BPE token"),
    "an unknown kind": (
        lambda d: d["model"].update(minigpt={"kind": "wordpiece"}),
        "unknown minigpt tokenizer kind",
    ),
    "another model": (lambda d: d["model"].update(type="Unigram"), "not a BPE tokenizer.json"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_run_tokenizer_is_a_one_line_error(
    damage: str, default_run: Path, tmp_path: Path, runner
) -> None:
    import shutil

    change, message = DAMAGE[damage]
    run = tmp_path / "run"
    shutil.copytree(default_run, run)
    data = json.loads((run / "tokenizer.json").read_text())
    change(data)
    (run / "tokenizer.json").write_text(json.dumps(data))
    result = runner.invoke(app, ["generate", "--model", str(run), "-n", "1", "x"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "tokenizer.json" in lines[0] and "Traceback" not in result.output
