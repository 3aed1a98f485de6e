"""Fine-tuning: conversation data and its errors, the assistant-only loss, full fine-tuning with new token
rows, and LoRA adapters (frozen base, merge, base check, exact resume)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT
from numerics import assert_near_exact, float64_logits

from minigpt.chat.data import ConversationSplit, padded_width, prepare_conversations
from minigpt.chat.template import CHAT_TOKENS, ChatTemplate, Message, with_chat_tokens
from minigpt.common.files import load_tensors
from minigpt.common.settings import nested_names
from minigpt.data.dataset import DataConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.generate.load import load_engine
from minigpt.model.build import build_model, model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.lora import VECTORS, LoRAConfig, adapter_shapes, merge, resolve_targets, trainable_count
from minigpt.runs.folder import RunDir
from minigpt.train.finetune import full_model, plan_fine_tune
from minigpt.train.loop import TrainConfig, train
from minigpt.train.optimizers import make_optimizer
from minigpt.train.reporters import LineReporter

WORDS = "apple banana cherry grape lemon mango peach plum".split()
BASE_TEXT = "".join(
    f"reverse: {' '.join(WORDS[i % 8 : i % 8 + 3])}. upper: {WORDS[i % 8].upper()} be brief.\n"
    for i in range(300)
)


def conversations(n: int = 40) -> list[dict]:
    records = []
    for i in range(n):
        ws = [WORDS[(i + k) % 8] for k in range(3)]
        if i % 2:
            records.append({"prompt": "upper: " + " ".join(ws), "completion": " ".join(ws).upper()})
        else:
            records.append({"messages": [
                {"role": "system", "content": "be brief."},
                {"role": "user", "content": "reverse: " + " ".join(ws)},
                {"role": "assistant", "content": " ".join(reversed(ws))},
            ]})  # fmt: skip
    return records


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


FAST = dict(batch_size=4, eval_iters=2, eval_every=4, log_every=4, warmup=2, max_iters=8, device="cpu",
            dtype="float32")  # fmt: skip


def tiny(**kw) -> TrainConfig:
    """A tiny base model's settings."""
    model = {k: kw.pop(k) for k in list(kw) if k in nested_names(TrainConfig, "overrides")}
    return TrainConfig(**{**FAST, "preset": "tiny", **kw}, overrides={"block_size": 64, **model})


def ft(**kw) -> TrainConfig:
    """Fine-tuning settings: the shape is the base run's."""
    return TrainConfig(**{**FAST, **kw})


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny char model trained for a few steps on text holding every character the conversations use."""
    root = tmp_path_factory.mktemp("base")
    text = root / "base.txt"
    text.write_text(BASE_TEXT)
    data = DataConfig(paths=(text,), tokenizer="char", cache_dir=root / "cache")
    train(tiny(max_iters=6, arch="modern"), data, out=root / "run")
    return root / "run"


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", conversations())


def chat_data(path: Path, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(paths=(path,), cache_dir=tmp_path / "cache", **kw)


# ---------------------------------------------------------------------------------------------- data


BAD_RECORDS = [
    ("{not json", "not a JSON record"),
    ('["a list"]', "not a JSON object"),
    ({"text": "hello"}, 'neither "messages" nor "prompt"'),
    ({"messages": []}, "not a non-empty list"),
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}, "message 1 has no role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "message 1 has role 'tool'"),
    (
        {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "yo"}]},
        "empty content",
    ),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "yo"}]}, "not text"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "weight": 2}]},
        "weight",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "late"},
                {"role": "assistant", "content": "a"},
            ]
        },
        "only the first",
    ),  # fmt: skip
    ({"prompt": "upper: plum"}, "completion has no content"),
    ({"prompt": "upper: plum " * 30, "completion": "PLUM"}, "more than the model's context of 64"),
    ({"prompt": "upper: plum", "completion": "PLUM \u00e9"}, "never saw"),
]


@pytest.mark.parametrize("record, why", BAD_RECORDS, ids=[w for _, w in BAD_RECORDS])
def test_a_bad_record_is_an_error_naming_file_and_line(
    record: object, why: str, base_run: Path, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [*conversations(3), "", record, *conversations(3)])
    tok = with_chat_tokens(RunDir(base_run).tokenizer(), 0)
    with pytest.raises(MinigptError) as e:
        prepare_conversations(chat_data(path, tmp_path), [path], 64, tok)
    message = str(e.value)
    assert message.startswith(f"{path}:5: ") and why in message and "--skip-bad-records" in message
    assert "\n" not in message


def test_bad_records_are_skipped_and_counted_when_asked(base_run: Path, tmp_path: Path) -> None:
    bad = [r for r, _ in BAD_RECORDS]
    path = write_jsonl(tmp_path / "chat.jsonl", [*conversations(20), *bad])
    notes: list[str] = []
    tok = with_chat_tokens(RunDir(base_run).tokenizer(), 0)
    data = prepare_conversations(
        chat_data(path, tmp_path, skip_bad_records=True), [path], 64, tok, notes.append
    )
    assert data.train.conversations + data.val.conversations == 20
    assert data.skipped.total == len(bad)
    assert data.skipped.first is not None and data.skipped.first.startswith(f"{path}:21: not a JSON record")
    assert any(n.startswith(f"skipped {len(bad)} bad record(s) (") for n in notes)


def test_conversations_split_and_count_assistant_tokens(
    chat_file: Path, base_run: Path, tmp_path: Path
) -> None:
    tok = with_chat_tokens(RunDir(base_run).tokenizer(), 0)
    data = prepare_conversations(chat_data(chat_file, tmp_path), [chat_file], 64, tok)
    assert (data.train.conversations, data.val.conversations) == (36, 4)  # the last 10% validates
    template = ChatTemplate(tok)
    last = template.render([Message("user", conversations()[-1]["prompt"]),
                            Message("assistant", conversations()[-1]["completion"])])  # fmt: skip
    split = ConversationSplit.of([last])
    assert len(split) == len(conversations()[-1]["completion"]) + 1  # its answer and the closing <|end|>
    answers = [r.get("completion") or r["messages"][-1]["content"] for r in conversations()[-4:]]
    assert data.val_bytes == sum(map(len, answers))  # the answers' text; <|end|> is no text


def test_batches_are_padded_to_a_few_widths_that_change_no_loss() -> None:
    """Widths round up to 16 tokens (an eighth of their power of two from 128 on), never past the split's
    longest conversation; the padding predicts nothing, so the loss is what the unpadded batch gives."""
    assert [padded_width(n, 10**6) for n in (1, 16, 17, 127, 129, 255, 257, 1000)] == [
        16, 16, 32, 128, 144, 256, 288, 1024,
    ]  # fmt: skip
    assert padded_width(40, 37) == 37
    rng = np.random.default_rng(0)
    rendered = [(rng.integers(1, 30, n).tolist(), [False] + [True] * (n - 1)) for n in (11, 23, 70)]
    split = ConversationSplit.of(rendered)
    assert split.widest == 69
    x, y = split.batch([0, 1])
    assert x.shape == (2, 32) and (y[0, 10:] == -1).all() and (y[1, 22:] == -1).all()
    assert split.batch([0, 2])[0].shape == (2, 69)  # 80 would pass the longest conversation
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=69, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        padded = model(x, y)[1]
        exact = model(x[:, :22], y[:, :22])[1]
    torch.testing.assert_close(padded, exact, rtol=1e-6, atol=1e-6)


def test_the_loss_gives_no_gradient_to_what_the_assistant_does_not_say(base_run: Path) -> None:
    """Logits at every position whose next token is not the assistant's get exactly zero gradient; the
    others get some; and changing a non-assistant token there changes no target."""
    tok = with_chat_tokens(RunDir(base_run).tokenizer(), 0)
    template = ChatTemplate(tok)
    rendered = [
        template.render([Message("system", "be brief."), Message("user", "reverse: plum lemon"),
                         Message("assistant", "lemon plum")]),
        template.render([Message("user", "upper: plum"), Message("assistant", "PLUM"),
                         Message("user", "upper: lemon"), Message("assistant", "LEMON")]),
    ]  # fmt: skip
    x, y = ConversationSplit.of(rendered).batch([0, 1])
    for row, (ids, targets) in enumerate(rendered):
        want = [i if t else -1 for i, t in zip(ids[1:], targets[1:], strict=True)]
        assert y[row, : len(want)].tolist() == want and (y[row, len(want) :] == -1).all()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32))
    _, loss = model(x, y)  # the training loss (head_loss: -1 targets ignored, logits never whole)
    loss.backward()
    trained = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, _ = model(x, all_logits=True)  # the same loss through the whole logits, for their gradient
    logits.retain_grad()
    flat = logits.reshape(-1, logits.size(-1))
    reference = torch.nn.functional.cross_entropy(flat, y.reshape(-1), ignore_index=-1)
    reference.backward()
    grad = logits.grad.abs().sum(-1)
    assert (grad[y == -1] == 0).all()
    assert (grad[y >= 0] > 0).all()
    assert loss.item() == pytest.approx(reference.item())
    for name, p in model.named_parameters():  # float32, two layers: sums in another order
        torch.testing.assert_close(trained[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- full fine-tuning


def test_full_fine_tuning_adds_the_chat_tokens_as_mean_rows(
    chat_file: Path, base_run: Path, tmp_path: Path
) -> None:
    tokenizer, shape, lora = plan_fine_tune(base_run, TrainConfig(), chat=True)
    base_tok, base_shape = RunDir(base_run).tokenizer(), RunDir(base_run).model_config()
    assert lora is None and shape.vocab_size == base_shape.vocab_size + 4
    assert [tokenizer.specials[t] for t in CHAT_TOKENS] == list(
        range(base_tok.vocab_size, base_tok.vocab_size + 4)
    )
    model = full_model(shape, base_run, torch.device("cpu"))
    base = RunDir(base_run).load_weights(base_shape)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        grown = model.get_parameter(name).detach()
        assert torch.equal(grown[: base_shape.vocab_size], base[name])
        assert torch.allclose(grown[base_shape.vocab_size :], base[name].mean(0).expand(4, -1))
    result = train(ft(max_iters=4), chat_data(chat_file, tmp_path), out=tmp_path / "ft", init_from=base_run)
    assert result.state.step == 4
    run = RunDir(tmp_path / "ft")
    assert run.tokenizer().specials == tokenizer.specials
    assert run.model_config().vocab_size == shape.vocab_size and run.weights_path.is_file()


@pytest.mark.slow
def test_value_embeddings_grow_with_the_chat_tokens_and_lora_refuses_them(
    chat_file: Path, tmp_path: Path
) -> None:
    """Value embeddings hold a row per token: full fine-tuning grows them as it grows the embedding (the
    mean row), while LoRA, which cannot add rows to a frozen table, says so in one line."""
    text = tmp_path / "base.txt"
    text.write_text(BASE_TEXT)
    data = DataConfig(paths=(text,), tokenizer="char", cache_dir=tmp_path / "cache")
    train(tiny(max_iters=2, arch="modern", value_embeds=True, skips=True), data, out=tmp_path / "base")
    base_shape = RunDir(tmp_path / "base").model_config()
    _, shape, _ = plan_fine_tune(tmp_path / "base", TrainConfig(), chat=True)
    model = full_model(shape, tmp_path / "base", torch.device("cpu"))
    base = RunDir(tmp_path / "base").load_weights(base_shape)
    name = "transformer.h.1.attn.v_embed.weight"
    grown = model.get_parameter(name).detach()
    assert grown.size(0) == shape.vocab_size and torch.equal(grown[: base_shape.vocab_size], base[name])
    assert torch.allclose(grown[base_shape.vocab_size :], base[name].mean(0).expand(4, -1))
    with pytest.raises(UsageError, match=r"value embeddings .* \(drop --lora-rank\)"):
        plan_fine_tune(tmp_path / "base", TrainConfig(lora_rank=2), chat=True)
    result = train(
        ft(max_iters=2), chat_data(chat_file, tmp_path), out=tmp_path / "ft", init_from=tmp_path / "base"
    )
    assert result.state.step == 2 and RunDir(tmp_path / "ft").model_config().value_embeds
    with pytest.raises(UsageError, match="conversations train whole: drop --seq-ramp"):
        train(ft(max_iters=2, seq_ramp=0.5), chat_data(chat_file, tmp_path), out=tmp_path / "ft2",
              init_from=tmp_path / "base")  # fmt: skip
    assert not (tmp_path / "ft2" / RunDir.WEIGHTS).exists()


def test_hf_imported_models_get_rows_past_their_padded_vocabulary(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from minigpt.convert.hf import from_hf
    from minigpt.tokenizer.bpe import GPT2_SPLIT_PATTERN, BPETokenizer
    from minigpt.tokenizer.hf import bpe_vocab_merges

    bpe = BPETokenizer.train([BASE_TEXT], vocab_size=300, pattern=GPT2_SPLIT_PATTERN)
    vocab, merges = bpe_vocab_merges(bpe.ranks, bpe.specials)
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=bpe.vocab_size + 5, n_layer=1, n_head=2, n_embd=16, n_positions=64
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    (hf / "vocab.json").write_text(json.dumps(vocab))
    (hf / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    from_hf(hf, tmp_path / "run")
    tokenizer, shape, _ = plan_fine_tune(tmp_path / "run", TrainConfig(), chat=True)
    assert min(tokenizer.specials[t] for t in CHAT_TOKENS) == bpe.vocab_size + 5
    assert shape.vocab_size == bpe.vocab_size + 9
    model = full_model(shape, tmp_path / "run", torch.device("cpu"))
    wte = model.transformer.wte.weight.detach()
    assert torch.allclose(wte[-1], wte[: bpe.vocab_size + 5].mean(0))


# ---------------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("targets", ["all", "all,embedding,head", "head", "all,norms", "qkv,norms,biases"])
@pytest.mark.parametrize("tie", [True, False])
def test_merged_weights_equal_the_adapted_forward(tie: bool, targets: str) -> None:
    torch.manual_seed(0)
    norm = "layernorm" if "biases" in targets else "rmsnorm"  # LayerNorm: gains and biases, with qk-norm's
    shape = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=tie,
                      mlp="swiglu", pos="rope", norm=norm, qk_norm="biases" in targets, bias=True)  # fmt: skip
    base = GPT(replace(shape, vocab_size=36))
    layers, whole = resolve_targets(targets, shape)
    lora = LoRAConfig(4, 8.0, layers, new_rows=4, whole=whole)
    adapted = GPT(shape, lora)
    adapted.load_state_dict(model_tensors(base), strict=False)
    with torch.no_grad():  # an adapter as training leaves it: every factor non-zero, whole matrices changed
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=0.2)
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained == set(model_tensors(adapted)) == set(adapter_shapes(shape, lora))
    assert {n for n in trained if ".lora_" not in n and "added" not in n} == set(whole)
    merged = build_model(
        shape, merge(model_tensors(base), model_tensors(adapted), lora, torch.cat), Path("x")
    )
    idx = torch.randint(0, 40, (3, 16))
    exact = float64_logits(adapted, idx, all_logits=True)
    with torch.no_grad():
        got, reference = merged(idx, all_logits=True)[0], adapted(idx, all_logits=True)[0]
    assert_near_exact(got, exact, shape, "merged")  # each float32 forward within rounding of the exact one
    assert_near_exact(reference, exact, shape, "adapted")
    if not any(w in targets for w in VECTORS):  # logits of the scale the 1e-5 assumes
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)


def test_lora_targets_and_the_trainable_count() -> None:
    shape = GPTConfig(vocab_size=100, block_size=16, n_layer=3, n_head=2, n_embd=32, mlp="gelu")
    everything = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert resolve_targets("all", shape) == (everything, ())
    assert resolve_targets("qkv,down", shape) == (("attn.c_attn", "mlp.c_proj"), ())
    untied = replace(shape, tie_embeddings=False)
    assert resolve_targets("all,head", untied) == (everything, ("lm_head.weight",))
    assert resolve_targets("head,embedding", untied) == ((), ("transformer.wte.weight", "lm_head.weight"))
    assert resolve_targets("head", shape) == ((), ("transformer.wte.weight",))  # a tied head is the embedding
    with pytest.raises(UsageError, match="no gate"):
        resolve_targets("gate", shape)
    with pytest.raises(UsageError, match="choose from"):
        resolve_targets("q_proj", shape)
    norms = tuple(
        f"transformer.h.{i}.{n}.{p}" for i in range(3) for n in ("ln_1", "ln_2") for p in ("weight", "bias")
    )
    norms += ("transformer.ln_f.weight", "transformer.ln_f.bias")  # LayerNorm: a gain and a bias each
    assert resolve_targets("norms", shape) == ((), norms)
    assert resolve_targets("all,norms", shape) == (everything, norms)
    biases = tuple(f"transformer.h.{i}.{t}.bias" for i in range(3) for t in everything)
    assert resolve_targets("biases", shape) == ((), biases)
    rms = replace(shape, norm="rmsnorm", bias=False)
    assert resolve_targets("norms", rms)[1] == (*(f"transformer.h.{i}.{n}.weight" for i in range(3)
                                                  for n in ("ln_1", "ln_2")), "transformer.ln_f.weight")  # fmt: skip
    with pytest.raises(UsageError, match="no biases"):
        resolve_targets("all,biases", rms)
    vectors = LoRAConfig(2, 4.0, everything, whole=norms + biases)
    factors, biases_n = 3 * 2 * (32 + 96 + 32 + 32 + 32 + 128 + 128 + 32), 3 * (96 + 32 + 128 + 32)
    assert trainable_count(shape, vectors) == factors + 14 * 32 + biases_n
    assert sum(p.numel() for p in GPT(shape, vectors).parameters() if p.requires_grad) == trainable_count(
        shape, vectors
    )
    assert LoRAConfig.from_json(vectors.to_json(), "x") == vectors
    with pytest.raises(MinigptError, match="does not have"):  # a stranger's adapter naming a layer 7
        trainable_count(shape, LoRAConfig(2, 4.0, everything, whole=("transformer.h.7.ln_1.weight",)))
    layers, whole = resolve_targets("attn,head", untied)
    with_head = LoRAConfig(2, 4.0, layers, new_rows=3, whole=whole)
    assert trainable_count(untied, with_head) == 3 * 2 * (32 + 96 + 32 + 32) + 3 * 32 * 2 + 97 * 32
    assert sum(p.numel() for p in GPT(untied, with_head).parameters() if p.requires_grad) == trainable_count(
        untied, with_head
    )
    assert LoRAConfig.from_json(with_head.to_json(), "x") == with_head
    old = with_head.to_json()
    del old["whole"]  # an adapter saved before whole matrices existed
    assert LoRAConfig.from_json(old, "x").whole == ()
    with pytest.raises(MinigptError, match="damaged LoRA settings"):
        LoRAConfig.from_json({**with_head.to_json(), "whole": ["transformer.h.0.attn.c_attn.weight"]}, "x")
    lora = LoRAConfig(2, 4.0, resolve_targets("attn", shape)[0], new_rows=3)
    model = GPT(shape, lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == trainable_count(shape, lora) == 3 * 2 * (32 + 96 + 32 + 32) + 3 * 32
    optimizer = make_optimizer(model, TrainConfig(lr=1e-3, optimizer="muon", muon_lr=0.02).with_recipe("cpu"))
    assert len(optimizer.parts) == 1  # the factors go to AdamW, and there is nothing else to train
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == trained


@pytest.fixture
def lora_run(chat_file: Path, base_run: Path, tmp_path: Path) -> Path:
    train(
        ft(max_iters=4, lora_rank=4),
        chat_data(chat_file, tmp_path),
        out=tmp_path / "lora",
        init_from=base_run,
    )
    return tmp_path / "lora"


@pytest.mark.slow
def test_a_lora_run_saves_only_its_adapter_and_every_engine_runs_it(lora_run: Path, base_run: Path) -> None:
    run = RunDir(lora_run)
    assert run.adapter_path.is_file() and not run.weights_path.exists()
    tensors, meta = load_tensors(run.adapter_path)
    assert all(n.endswith((".lora_A", ".lora_B", ".added")) for n in tensors)
    assert meta["format"] == "minigpt-adapter" and meta["step"] == "4"
    from minigpt.model.lora import file_sha256

    assert meta["base_sha256"] == file_sha256(RunDir(base_run).weights_path)
    config = run.model_config()
    shape_base = RunDir(base_run).model_config()
    assert config.vocab_size == shape_base.vocab_size + 4
    assert run.stored_param_count() == GPT(config).num_params()
    # both engines load the base with the adapter merged, and agree
    tokens = {}
    for backend in ("numpy", "torch"):
        engine, tok = load_engine(lora_run, backend)
        ids = ChatTemplate(tok).prompt([Message("user", "reverse: plum lemon")])
        from minigpt.generate.decode import Generation

        gen = Generation(engine, tok, ids, max_new_tokens=12, temperature=0)
        gen.run()
        tokens[backend] = gen.token_ids[0]
    assert tokens["numpy"] == tokens["torch"]


@pytest.mark.slow
def test_an_adapter_is_refused_on_another_base(lora_run: Path, base_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    train(tiny(max_iters=6, arch="modern", seed=7), DataConfig(paths=(Path(RunDir(base_run).read_config()["data"]["paths"][0]),),
          tokenizer="char", cache_dir=tmp_path / "cache"), out=other)  # fmt: skip
    with pytest.raises(MinigptError, match="trained on other base weights"):
        RunDir(lora_run, base=other).load_model()
    # the same refusal when the base run itself was replaced in place
    moved = tmp_path / "lora2"
    moved.mkdir()
    for name in (RunDir.CONFIG, RunDir.TOKENIZER, RunDir.ADAPTER):
        (moved / name).write_bytes((lora_run / name).read_bytes())
    config = json.loads((moved / RunDir.CONFIG).read_text())
    config["adapter"]["base"] = str(other)
    (moved / RunDir.CONFIG).write_text(json.dumps(config))
    with pytest.raises(MinigptError, match="only apply to their own base"):
        load_engine(moved, "numpy")
    with pytest.raises(MinigptError, match="is not there"):
        RunDir(lora_run, base=tmp_path / "nowhere").load_model()


@pytest.mark.slow
def test_exact_resume_of_a_lora_run_is_bitwise(chat_file: Path, base_run: Path, tmp_path: Path) -> None:
    data = chat_data(chat_file, tmp_path)
    cfg = ft(max_iters=8, lora_rank=4, lora_targets="attn,down,head,norms")
    straight = train(cfg, data, out=tmp_path / "straight", init_from=base_run)

    def stop_at_4(step: int) -> None:
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(cfg, data, out=tmp_path / "split", init_from=base_run, on_step=stop_at_4)
    assert first.interrupted and first.state.step == 4
    resumed = train(TrainConfig(), resume=tmp_path / "split")
    assert resumed.state.step == 8
    a, _ = load_tensors(tmp_path / "straight" / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    assert a.keys() == b.keys()
    head = (
        "model/transformer.wte.weight"
        if RunDir(base_run).model_config().tie_embeddings
        else "model/lm_head.weight"
    )
    assert head in a and f"optim/{head.removeprefix('model/')}/exp_avg" in a  # the head, trained whole
    assert "optim/transformer.ln_f.weight/exp_avg" in a  # and the norms
    assert all(k.startswith(("model/transformer.h.", "model/transformer.wte.added", "model/lm_head.added", head,
                             "model/transformer.ln_f."))
               for k in a if k.startswith("model/"))  # fmt: skip
    for key in a:
        if key.startswith(("model/", "optim/")):
            assert torch.equal(a[key], b[key]), key
    assert straight.state.best_val_loss == resumed.state.best_val_loss


@pytest.mark.slow
def test_lora_needs_a_run_to_adapt(chat_file: Path, base_run: Path, lora_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--init-from"):
        train(ft(lora_rank=4), chat_data(chat_file, tmp_path), out=tmp_path / "x")
    with pytest.raises(UsageError, match="is a LoRA run: merge it"):
        train(ft(lora_rank=4), chat_data(chat_file, tmp_path), out=tmp_path / "y", init_from=lora_run)
    # full fine-tuning of a LoRA run starts from its merged weights
    result = train(ft(max_iters=2), chat_data(chat_file, tmp_path), out=tmp_path / "z", init_from=lora_run)
    assert result.state.step == 2


@pytest.mark.slow
def test_lora_fine_tuning_under_two_processes_then_resumed_on_one(
    chat_file: Path, base_run: Path, tmp_path: Path
) -> None:
    """`--nproc 2` trains the adapter with the base frozen on both ranks; the run resumes in one process."""
    out = tmp_path / "ddp"
    before = (base_run / RunDir.WEIGHTS).read_bytes()
    cmd = [sys.executable, "-m", "minigpt", "train", "--init-from", str(base_run), str(chat_file), "--lora-rank",
           "2", "--max-iters", "2", "--batch-size", "2", "--eval-iters", "1", "--device", "cpu", "--out", str(out),
           "--nproc", "2"]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MINIGPT_DIST_TIMEOUT": "30",
        "MINIGPT_CACHE_DIR": str(tmp_path),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RunDir(out).adapter_path.is_file() and not RunDir(out).weights_path.exists()
    assert (base_run / RunDir.WEIGHTS).read_bytes() == before
    _, meta = load_tensors(out / RunDir.STATE)
    assert json.loads(meta["state"])["world_size"] == 2
    resumed = train(TrainConfig(max_iters=4), resume=out)
    assert resumed.state.step == 4


@pytest.mark.slow
def test_a_lora_run_keeps_a_time_budget_and_says_what_it_trains(
    chat_file: Path, base_run: Path, tmp_path: Path
) -> None:
    """Steps of 1 s on a fake clock under a 20 s budget end in time; the log names the adapter and the data."""

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock, log = Clock(), io.StringIO()

    def one_second_steps(step: int) -> None:
        clock.now += 1.0

    cfg = ft(max_iters=None, max_time=20.0, eval_every=10_000, lora_rank=4, lora_targets="qkv")
    result = train(cfg, chat_data(chat_file, tmp_path), out=tmp_path / "t", init_from=base_run, clock=clock,
                   started=clock.now, on_step=one_second_steps, reporter=LineReporter(log))  # fmt: skip
    assert result.stop_reason == "reached max_time 20 s" and 10 <= result.state.step <= 20
    text = log.getvalue()
    assert "fine-tuning: LoRA rank 4 (alpha 8) on attn.c_attn and 4 new token rows: " in text
    assert "data: 36 train / 4 val conversations (" in text and "assistant tokens)" in text
    assert f"chat with: minigpt chat {tmp_path / 't'}" in text


@pytest.mark.slow
def test_eval_scores_conversations_on_the_answers(runner, lora_run: Path, chat_file: Path) -> None:
    from minigpt.cli.main import app

    result = runner.invoke(app, ["eval", str(lora_run), str(chat_file), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    scored = json.loads(result.stdout)
    model, tok, _ = RunDir(lora_run).load_model()
    template = ChatTemplate(tok)
    rendered = [template.render(parse) for parse in (
        [Message("user", r["prompt"]), Message("assistant", r["completion"])] if "prompt" in r
        else [Message(m["role"], m["content"]) for m in r["messages"]] for r in conversations()
    )]  # fmt: skip
    x, y = ConversationSplit.of(rendered).batch(list(range(len(rendered))))
    with torch.no_grad():
        logits, _ = model(x, all_logits=True)
    want = torch.nn.functional.cross_entropy(logits[y >= 0], y[y >= 0]).item()
    assert scored["tokens"] == int((y >= 0).sum()) and scored["windows"] == 40
    assert scored["loss"] == pytest.approx(want, rel=1e-5)
