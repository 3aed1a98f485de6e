"""`--attn-score`: each score against its formula in an explicit loop, the additive score's bounded chunks and
their memory estimate, general folding into W_Q, and the option through every command."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_decode import GREEDY, numpy_twin

from minigpt.cli.main import app
from minigpt.convert.hf_map import family_for
from minigpt.errors import MinigptError
from minigpt.generate.decode import Generation, encode_prompt
from minigpt.generate.engines import numpy_engine as nm
from minigpt.generate.load import load_engine
from minigpt.model import gpt as tm
from minigpt.model import memory, rotary
from minigpt.model.config import SCORES, GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.weights import AttentionWeights
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer
from minigpt.train import run as trainsetup

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n" for i, w in enumerate(["a", "b"] * 80)
)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def config(score: str, **kw: Any) -> GPTConfig:
    base = dict(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32, attn_score=score)
    return GPTConfig(**{**base, **kw})


def scaled_up(cfg: GPTConfig, seed: int = 0, scale: float = 3.0) -> GPT:
    """Random weights with the matrices scaled up, so attention is far from uniform, and the score's maps
    moved off their initialisation (general's identity would not tell W from its transpose)."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
            if ".attn.score" in name:
                p.add_(torch.randn_like(p), alpha=0.5)
    return model


# --- each score against its formula --------------------------------------------------------------------


def reference_probabilities(
    cfg: GPTConfig, w: AttentionWeights[torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of x (B, T, C) over itself written out one (row, head, query) at a time: the query's logit
    over each key by the score's formula, -inf where the query may not look (later keys, or outside its
    window), softmax. The probabilities (B, H, T, T) and the values (B, T, n_kv_head, hd) they weight; key/value
    head h // (H / n_kv_head) serves query head h."""
    B, T, C = x.shape
    H, hd, kv = cfg.n_head, cfg.head_dim, cfg.kv_heads
    proj = x @ w.c_attn.weight.T + w.c_attn.bias
    q = proj[..., : H * hd].reshape(B, T, H, hd)
    k = proj[..., H * hd : (H + kv) * hd].reshape(B, T, kv, hd)
    v = proj[..., (H + kv) * hd :].reshape(B, T, kv, hd)
    maps = w.score_maps
    probs = []
    for b, h, i in itertools.product(range(B), range(H), range(T)):
        query = maps[0][h] @ q[b, i, h] if cfg.attn_score == "general" else q[b, i, h]
        logits = []
        for j in range(T):
            key = k[b, j, h // (H // kv)]
            if not i - w.window < j <= i:
                logits.append(torch.tensor(-math.inf))
            elif cfg.attn_score == "scaled":
                logits.append(query @ key / math.sqrt(hd))
            elif cfg.attn_score in ("dot", "general"):
                logits.append(query @ key)
            else:  # additive: vᵀ tanh(W₁q + W₂k)
                logits.append(maps[2][h, 0] @ torch.tanh(maps[0][h] @ query + maps[1][h] @ key))
        probs.append(torch.softmax(torch.stack(logits), dim=0))
    return torch.stack(probs).reshape(B, H, T, T), v


def reference_attention(cfg: GPTConfig, w: AttentionWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Self-attention of x (B, T, C): `reference_probabilities` weighting the values, then the output
    projection."""
    B, T, C = x.shape
    probs, v = reference_probabilities(cfg, w, x)
    groups = cfg.n_head // cfg.kv_heads
    y = probs @ v.transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, H, T, hd)
    return y.transpose(1, 2).reshape(B, T, C) @ w.c_proj.weight.T + w.c_proj.bias


SETTINGS = [dict(), dict(n_kv_head=2, window=5, window_pattern="S")]


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("options", SETTINGS, ids=["full", "gqa-window"])
@pytest.mark.parametrize("chunk", [None, 1], ids=["one-chunk", "query-chunks"])
def test_each_score_is_its_formula_in_an_explicit_loop(
    score: str, options: dict[str, Any], chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused path, the explicit one (`attention` list) and the NumPy engine all compute the loop; with a
    budget of one query's values the additive score runs one query per chunk."""
    cfg = config(score, **options)
    if chunk is not None:
        monkeypatch.setattr(memory, "SCORE_CHUNK_VALUES", 2 * cfg.n_head * cfg.additive_width * 11)
    model = scaled_up(cfg)
    w = model.weights().h[0].attn
    x = torch.randn(2, 11, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference_attention(cfg, w, x)
        fused = tm.attend(w, x, 0)
        probs: list[torch.Tensor] = []
        explicit = tm.attend(w, x, 0, attention=probs)
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(explicit, want, rtol=1e-4, atol=1e-5)
    seen = probs[0] > 0  # (B, H, T, T): masked before the softmax, every row a distribution
    assert seen.sum(-1)[0, 0].tolist() == [min(i + 1, w.window) for i in range(11)]
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2, cfg.n_head, 11))
    got = nm.attend(numpy_twin(model).weights.h[0].attn, x.numpy(), 0, None, None)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_additive_gradients_through_checkpointed_chunks_are_the_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training recomputes each chunk in the backward pass: the gradients of the input and of W₁, W₂, v are
    what autograd gives through the explicit loop."""
    cfg = config("additive", n_kv_head=2, window=6)
    monkeypatch.setattr(memory, "SCORE_CHUNK_VALUES", 2 * cfg.n_head * cfg.additive_width * 10 * 2)
    model = scaled_up(cfg, seed=3)
    w = model.weights().h[0].attn
    x = torch.randn(2, 10, cfg.n_embd, generator=torch.Generator().manual_seed(2), requires_grad=True)
    probe = torch.randn(2, 10, cfg.n_embd)
    grads = []
    for attend in (tm.attend, lambda w, x, layer: reference_attention(cfg, w, x)):
        model.zero_grad()
        x.grad = None
        (attend(w, x, 0) * probe).sum().backward()
        grads.append([x.grad.clone(), *(m.grad.clone() for m in w.score_maps)])
    for got, want in zip(*grads, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_query_chunks_bound_the_values_and_cover_every_visible_key() -> None:
    for queries, keys, window, per_pair in itertools.product(
        (1, 7, 64), (64, 100), (1, 5, 64, 100), (1, 3, 4096)
    ):
        if queries > keys:
            continue
        chunks = memory.score_chunks(queries, keys, window, per_pair)
        assert [c[0] for c in chunks] == sorted(c[0] for c in chunks) and chunks[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks)) and chunks[-1][1] == queries
        visible = tm.attention_mask(queries, keys, window, torch.device("cpu"))
        for t0, t1, k0, k1 in chunks:
            assert (t1 - t0) * (k1 - k0) * per_pair <= max(memory.SCORE_CHUNK_VALUES, keys * per_pair)
            rows = visible[t0:t1]
            assert rows[:, k0:k1].sum() == rows.sum() and rows[:, k0].any() and rows[:, k1 - 1].any()
    # the estimate is the largest chunk of a full block, as planned chunk by chunk
    for T, batch in itertools.product((1, 2, 63, 64, 65, 1000), (1, 3, 64, 5000)):
        cfg = config("additive", block_size=T, n_embd=64)
        per_pair = batch * cfg.n_head * cfg.additive_width
        largest = max((t1 - t0) * (k1 - k0) for t0, t1, k0, k1 in memory.score_chunks(T, T, T, per_pair))
        assert memory.score_bytes(cfg, batch, training=False) == largest * per_pair * 4, (T, batch)


# --- the memory the additive score needs, estimated before allocating ------------------------------------


def test_the_additive_estimate_is_its_largest_chunk_and_train_refuses_it_in_one_line(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config("additive", block_size=64, n_embd=64)
    per_pair = 64 * cfg.n_head * cfg.additive_width  # batch 64: 16 queries a chunk, the last over 64 keys
    assert memory.SCORE_CHUNK_VALUES // (64 * per_pair) == 16
    assert memory.score_bytes(cfg, 64, training=False) == 16 * 64 * per_pair * 4
    assert memory.score_bytes(cfg, 64, training=True) == 4 * 16 * 64 * per_pair * 4
    assert memory.score_bytes(replace(cfg, attn_score="general"), 64, training=True) == 0
    scaled = replace(cfg, attn_score="scaled")
    assert memory.inference_bytes(cfg) > memory.inference_bytes(scaled)
    # a query's row past the budget: a chunk is that one row, batch · T keys · H · d_a values; on top of
    # the scaled model's estimate, that and the maps W₁, W₂, v (float32)
    big = config("additive", block_size=4096, n_embd=64)
    H, L, hd, da = big.n_head, big.n_layer, big.head_dim, big.additive_width
    extra = memory.inference_bytes(big, 32) - memory.inference_bytes(replace(big, attn_score="scaled"), 32)
    assert extra == 4 * ((2 * da * hd + da) * H * L + 32 * 4096 * H * da)

    # train: the estimate with the additive chunk is checked before the model exists; it is what tips over
    estimates: dict[str, int] = {}

    def spy(shape: GPTConfig, batch: int) -> int:
        estimates["scaled"] = memory.training_bytes(replace(shape, attn_score="scaled"), batch)
        estimates["additive"] = memory.training_bytes(shape, batch)
        return estimates["additive"]

    monkeypatch.setattr(trainsetup, "training_bytes", spy)
    monkeypatch.setattr(memory, "available_bytes", lambda: (estimates["scaled"] + estimates["additive"]) // 2)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    args = ["train", str(text), "--preset", "tiny", "--tokenizer", "char", "--attn-score", "additive"]
    result = runner.invoke(app, [*args, "--batch-size", "64", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert errors == [result.output.strip().splitlines()[-1]]  # progress lines above it, one error line
    assert errors[0].startswith("error: training with batch_size 64 needs about")
    assert "lower batch_size" in errors[0] and not (tmp_path / "run" / RunDir.WEIGHTS).exists()


# --- general: a map of the queries that folds into W_Q ---------------------------------------------------


def test_general_folds_into_the_query_projection_and_starts_as_dot() -> None:
    general = scaled_up(config("general", bias=True), seed=4)
    torch.manual_seed(5)
    with torch.no_grad():
        for block in general.transformer.h:
            block.attn.score.weight.normal_(0, 0.5)
    dot = GPT(config("dot", bias=True)).eval()
    state = {k: v for k, v in general.state_dict().items() if ".attn.score" not in k}
    hd, rows = 8, 4 * 8
    for i in range(2):
        W = general.transformer.h[i].attn.score.weight.detach()  # (H, hd, hd)
        fold = torch.block_diag(*W)  # W of every head, applied to the query rows of c_attn
        for part in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.c_attn.{part}"
            state[name] = torch.cat([fold @ state[name][:rows], state[name][rows:]])
    dot.load_state_dict(state)
    idx = torch.randint(0, 29, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(general(idx, all_logits=True)[0], dot(idx, all_logits=True)[0])
    assert general.num_params() - dot.num_params() == 2 * 4 * hd * hd
    # at initialisation W is the identity: the same seed gives dot's model exactly, and every score
    # shares scaled's other weights
    fresh = {}
    for score in SCORES:
        torch.manual_seed(6)
        fresh[score] = GPT(config(score)).eval()
    with torch.no_grad():
        assert torch.equal(fresh["general"](idx)[0], fresh["dot"](idx)[0])
    shared = fresh["scaled"].state_dict()
    for model in fresh.values():
        assert all(torch.equal(t, shared[k]) for k, t in model.state_dict().items() if ".attn.score" not in k)


def test_general_keeps_rotary_scores_relative_and_dot_grows_with_the_head() -> None:
    """W acts before the rotation, so general's logits, like dot's, depend only on the distance; dot's
    logits are scaled's times √d_head."""
    model = scaled_up(config("general", pos="rope", n_head=2), seed=7)
    w = model.weights().h[0].attn
    x = torch.randn(1, 9, 32)

    def logits(start: int, weights: AttentionWeights[torch.Tensor] = w) -> torch.Tensor:
        rope = rotary.rotary(10000.0, 16, start, 9, x.device)
        q, k, _ = tm.qkv(weights, x, rope)
        return tm.attention_logits(weights, q, k)

    with torch.no_grad():
        torch.testing.assert_close(logits(0), logits(500), rtol=1e-4, atol=1e-4)
        dot, scaled = (logits(0, replace(w, score=s, score_maps=())) for s in ("dot", "scaled"))
    torch.testing.assert_close(dot, scaled * 4.0)


# --- through every command ----------------------------------------------------------------------------------


@pytest.fixture
def additive_run(runner, tmp_path: Path) -> Path:
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "run"
    args = ["train", str(text), "--preset", "tiny", "--tokenizer", "char", "--attn-score", "additive"]
    args += [
        "--n-kv-head",
        "1",
        "--max-iters",
        "4",
        "--eval-iters",
        "1",
        "--batch-size",
        "4",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_the_score_is_saved_and_honoured_by_every_command(runner, additive_run: Path, tmp_path: Path) -> None:
    config = RunDir(additive_run).model_config()
    assert json.loads((additive_run / RunDir.CONFIG).read_text())["model"]["attn_score"] == "additive"
    assert config.attn_score == "additive" and "additive attention scores" in config.architecture
    texts = []
    for backend in ("numpy", "torch"):
        result = runner.invoke(
            app, ["generate", "the", "-m", str(additive_run), "-n", "40", "-t", "0", "--backend", backend]
        )
        assert result.exit_code == 0, result.output
        texts.append(result.stdout)
    assert texts[0] == texts[1] and len(texts[0]) >= 40

    result = runner.invoke(app, ["eval", str(additive_run), str(tmp_path / "t.txt"), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["loss"] > 0

    result = runner.invoke(app, ["attention", "the quick", "-m", str(additive_run), "--layer", "0", "--json"])
    assert result.exit_code == 0, result.output
    grids = torch.tensor(json.loads(result.stdout)["weights"])  # (H, T, T)
    torch.testing.assert_close(grids.sum(-1), torch.ones(grids.shape[:2]), atol=1e-5, rtol=0)
    assert torch.all(grids.triu(diagonal=1) == 0)

    report = json.loads(runner.invoke(app, ["params", str(additive_run), "--json"]).stdout)
    assert report["exact_total"] == report["stored_total"]
    rows = {r["name"]: r["count"] for r in report["breakdown"]}
    hd, H, L = config.head_dim, config.n_head, config.n_layer
    assert rows["Score W₁ (additive, queries)"] == rows["Score W₂ (additive, keys)"] == hd * hd * H * L
    assert rows["Score v (additive)"] == hd * H * L

    result = runner.invoke(app, ["convert", "to-hf", str(additive_run), str(tmp_path / "hf")])
    assert result.exit_code == 1 and not (tmp_path / "hf").exists()
    assert result.output.strip().splitlines() == [
        "error: cannot convert to Hugging Face: this model has --attn-score additive; GPT-2, Llama and Qwen3 "
        "score attention by the scaled dot product only (--attn-score scaled)"
    ]


CHARS = list("abcdefghijklmnopqrstuvwxyz .\n")  # 29, the configs' vocabulary


@pytest.mark.slow
@pytest.mark.parametrize("score", SCORES)
def test_every_command_reads_the_score_from_a_saved_run(runner, tmp_path: Path, score: str) -> None:
    """A saved run of each score, grouped queries and a local first layer: `attention` shows the patterns
    the loop computes, `generate` gives one text on both engines (sliding past the block), `params`
    counts the module's tensors row by row, `eval` reads it, and only scaled converts."""
    cfg = config(score, n_kv_head=2, window=5, window_pattern="S")
    model = scaled_up(cfg, seed=9)
    run = tmp_path / "run"
    RunDir(run).save(model, CharTokenizer(CHARS), extra={})
    assert RunDir(run).model_config().attn_score == score

    text = "the lazy dog."
    result = runner.invoke(app, ["attention", text, "-m", str(run), "--layer", "0", "--json"])
    assert result.exit_code == 0, result.output
    got = torch.tensor(json.loads(result.stdout)["weights"])  # (H, T, T)
    ids = torch.tensor([[CHARS.index(c) for c in text]])
    b = model.weights().h[0]
    with torch.no_grad():
        x = tm.norm(b.ln_1, model.transformer.wte.weight[ids] + model.transformer.wpe.weight[: len(text)])
        want, _ = reference_probabilities(cfg, b.attn, x)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    assert torch.all(got[:, 6, :2] == 0)  # the window: position 6 sees positions 2..6 only

    texts = []
    for backend in ("numpy", "torch"):
        args = ["generate", "the", "-m", str(run), "-n", "30", "-t", "0", "--backend", backend]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        texts.append(result.stdout)
    assert texts[0] == texts[1] and len(texts[0]) >= 30

    report = json.loads(runner.invoke(app, ["params", str(run), "--json"]).stdout)
    assert report["exact_total"] == report["stored_total"] == sum(p.numel() for p in model.parameters())
    rows = {r["name"]: r["count"] for r in report["breakdown"]}
    maps = {name: p.numel() for name, p in model.named_parameters() if ".attn.score" in name}
    score_rows = {name: count for name, count in rows.items() if name.startswith("Score")}
    assert sum(score_rows.values()) == sum(maps.values())
    assert len(score_rows) == {"scaled": 0, "dot": 0, "general": 1, "additive": 3}[score]

    window = "the quick brown f"  # block_size + 1 characters: one window, 16 predictions
    (tmp_path / "t.txt").write_text(window)
    result = runner.invoke(app, ["eval", str(run), str(tmp_path / "t.txt"), "--json"])
    assert result.exit_code == 0, result.output
    ids = torch.tensor([[CHARS.index(c) for c in window]])
    with torch.no_grad():
        logits = model(ids[:, :-1], all_logits=True)[0]
    want_loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert json.loads(result.stdout)["loss"] == pytest.approx(want_loss, rel=1e-5)

    if score != "scaled":
        result = runner.invoke(app, ["convert", "to-hf", str(run), str(tmp_path / "hf")])
        assert result.exit_code == 1 and not (tmp_path / "hf").exists()
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and f"this model has --attn-score {score};" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_serve_batches_an_additive_model_as_generate_decodes_it(additive_run: Path, backend: str) -> None:
    batcher_module = pytest.importorskip("minigpt.serve.batcher")
    engine, tok = load_engine(additive_run, backend)
    batcher = batcher_module.Batcher(engine, tok, max_rows=4)
    texts: dict[str, list[str]] = {}
    prompts = {"the": 30, "a b": 45}  # different lengths, decoded in one batch, sliding past the block

    def job(prompt: str, n: int) -> Any:
        texts[prompt] = [""]

        def notify(update: Any) -> None:
            texts[prompt][0] += "".join(piece.text for piece in update.pieces)

        return batcher_module.Job(
            encode_prompt(tok, prompt), n=1, max_tokens=n, sampling=GREEDY, notify=notify
        )

    for prompt, n in prompts.items():
        batcher.submit(job(prompt, n))
    while batcher.groups or batcher.waiting:
        batcher.step()
    for prompt, n in prompts.items():
        alone = Generation(engine, tok, encode_prompt(tok, prompt), max_new_tokens=n, temperature=0.0)
        assert texts[prompt] == [s.text for s in alone.run()], prompt


def test_only_scaled_converts_and_an_unknown_score_is_one_line(runner) -> None:
    for score in SCORES[1:]:
        with pytest.raises(MinigptError, match=f"this model has --attn-score {score};"):
            family_for(config(score))
    assert family_for(config("scaled")) == "gpt2"
    result = runner.invoke(app, ["params", "--attn-score", "cosine"])
    assert result.exit_code == 2
    assert "'cosine' is not one of 'scaled', 'dot', 'general', 'additive'" in result.output
    with pytest.raises(MinigptError, match="unknown attn_score 'cosine': choose scaled or dot or general or"):
        GPTConfig.from_dict({**config("scaled").to_dict(), "attn_score": "cosine"})
