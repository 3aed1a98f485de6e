"""Each architecture option against a reference written here: windows, rotary, GQA, norms, MLPs, the ring cache."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numerics import assert_near_exact, float64_logits
from test_decode import ENGINES, GREEDY, nanogpt_loop, numpy_twin, rows, tiny_model

from minigpt.errors import UsageError
from minigpt.generate.decode import decode
from minigpt.generate.engines import numpy_engine as nm
from minigpt.model import gpt as tm
from minigpt.model import rotary
from minigpt.model.build import model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.weights import LinearWeights, MLPWeights, NormWeights, check_shapes, expected_shapes


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def config(**kw: Any) -> GPTConfig:
    base = dict(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Query i of (B, H, T, hd) over keys max(0, i - window + 1)..i, one softmax at a time; key/value
    head h // (H / n_kv_head) serves query head h."""
    B, H, T, hd = q.shape
    group = H // k.size(1)
    out = torch.zeros_like(q)
    for b, h, i in itertools.product(range(B), range(H), range(T)):
        lo = max(0, i - window + 1)
        keys, values = k[b, h // group, lo : i + 1], v[b, h // group, lo : i + 1]
        weights = torch.softmax(keys @ q[b, h, i] / math.sqrt(hd), dim=0)
        out[b, h, i] = weights @ values
    return out


@pytest.mark.parametrize(("window", "n_kv_head"), [(1, None), (3, None), (5, 2), (16, 1)])
def test_attention_with_a_window_is_the_masked_softmax_loop(window: int, n_kv_head: int | None) -> None:
    cfg = config(n_layer=1, window=window, n_kv_head=n_kv_head, pos="rope", qk_norm=True)
    cfg = GPTConfig(**{**cfg.to_dict(), "n_layer": 2, "window_pattern": "S"})  # layer 0 is local
    model = tiny_model(0, cfg, scale=3.0)
    w = model.weights().h[0].attn
    x = torch.randn(2, 13, cfg.n_embd)
    rope = rotary.rotary(cfg.rope_base, cfg.head_dim, 0, 13, x.device)
    with torch.no_grad():
        q, k, v = tm.qkv(w, x, rope)
        y = reference_attention(q, k, v, window)
        want = tm.linear(w.c_proj, y.transpose(1, 2).reshape(2, 13, cfg.n_embd))
        fused = tm.attend(w, x, 0, rope=rope)
        probs: list[torch.Tensor] = []
        explicit = tm.attend(w, x, 0, rope=rope, attention=probs)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(explicit, want, rtol=1e-5, atol=1e-5)
    seen = probs[0][0, 0] > 0  # (T, T): what each query attends to
    assert seen.sum(-1).tolist() == [min(i + 1, window) for i in range(13)]
    nw = numpy_twin(model).weights.h[0].attn
    got = nm.attend(nw, x.numpy(), 0, None, nm.rotary(cfg.rope_base, cfg.head_dim, 0, 13))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_rotary_scores_depend_only_on_the_distance() -> None:
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)

    def scores(start: int) -> torch.Tensor:
        rope = rotary.rotary(10000.0, 16, start, 9, q.device)
        return rotary.rotate(q, rope) @ rotary.rotate(k, rope).transpose(-1, -2)

    torch.testing.assert_close(scores(0), scores(1000), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores(0), q @ k.transpose(-1, -2), atol=1e-2)  # it does rotate
    rope = rotary.rotary(10000.0, 16, 5, 9, q.device)
    torch.testing.assert_close(rotary.rotate(q, rope).norm(dim=-1), q.norm(dim=-1))  # rotations keep lengths
    cos, sin = nm.rotary(10000.0, 16, 5, 9)
    np.testing.assert_allclose(nm.rotate(q.numpy(), (cos, sin)), rotary.rotate(q, rope).numpy(), atol=1e-5)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_grouped_query_attention_is_multi_head_with_repeated_key_value_heads(pos: str) -> None:
    grouped = tiny_model(1, config(n_kv_head=2, pos=pos, bias=True), scale=3.0)
    full = GPT(config(pos=pos, bias=True)).eval()
    hd, C = 8, 32
    state = dict(grouped.state_dict())
    for i in range(2):
        for part in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.c_attn.{part}"
            q, k, v = state[name].split([4 * hd, 2 * hd, 2 * hd])
            repeat = [t.unflatten(0, (2, hd)).repeat_interleave(2, dim=0).flatten(0, 1) for t in (k, v)]
            state[name] = torch.cat([q, *repeat])
    full.load_state_dict(state)
    idx = torch.randint(0, 29, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(grouped(idx, all_logits=True)[0], full(idx, all_logits=True)[0])
    assert grouped.num_params() < full.num_params()
    assert grouped.weights().h[0].attn.c_attn.weight.shape == ((4 + 2 * 2) * hd, C)


def test_norms_and_mlps_are_their_formulas() -> None:
    x = torch.randn(3, 5, 32)
    g, b = torch.randn(32), torch.randn(32)
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g
    centred = x - x.mean(-1, keepdim=True)
    layer = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + 1e-5) * g + b
    for got, want in (
        (tm.norm(NormWeights(g, None, 1e-5, True), x), rms),
        (tm.norm(NormWeights(g, b, 1e-5, False), x), layer),
        (torch.from_numpy(nm.norm(NormWeights(g.numpy(), None, 1e-5, True), x.numpy())), rms),
        (torch.from_numpy(nm.norm(NormWeights(g.numpy(), b.numpy(), 1e-5, False), x.numpy())), layer),
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    up, gate, down = torch.randn(64, 32) / 6, torch.randn(64, 32) / 6, torch.randn(32, 64) / 8
    h = x @ up.T
    gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    formulas = {
        "gelu": gelu @ down.T,
        "relu2": torch.where(h > 0, h * h, 0.0) @ down.T,
        "swiglu": ((x @ gate.T) * torch.sigmoid(x @ gate.T) * h) @ down.T,
    }
    for activation, want in formulas.items():
        gated = LinearWeights(gate, None) if activation == "swiglu" else None
        w = MLPWeights(LinearWeights(up, None), LinearWeights(down, None), gated, activation)
        torch.testing.assert_close(tm.mlp(w, x), want, rtol=1e-5, atol=1e-5)
        nw = MLPWeights(
            LinearWeights(up.numpy(), None),
            LinearWeights(down.numpy(), None),
            LinearWeights(gate.numpy(), None) if gated else None,
            activation,
        )
        np.testing.assert_allclose(nm.mlp(nw, x.numpy()), want.numpy(), rtol=1e-4, atol=1e-5)


OPTIONS = dict(
    pos=["learned", "rope"],
    norm=["layernorm", "rmsnorm"],
    mlp=["gelu", "relu2", "swiglu"],
    qk_norm=[False, True],
    n_kv_head=[None, 1],
    window=[None, 5],
    tie_embeddings=[True, False],
    bias=[True, False],
)
GRID = [dict(zip(OPTIONS, values, strict=True)) for values in itertools.product(*OPTIONS.values())]


@pytest.mark.slow
def test_every_combination_stores_the_tensors_its_config_names() -> None:
    for options in GRID:
        cfg = config(n_layer=3, **options)
        real = {k: tuple(v.shape) for k, v in model_tensors(GPT(cfg)).items()}
        assert expected_shapes(cfg) == real, options
        check_shapes(cfg, real, Path("w"))


@pytest.mark.slow
@pytest.mark.parametrize("options", GRID[::7], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_numpy_engine_equals_the_torch_model_for_every_option(options: dict[str, Any]) -> None:
    """Logits of a prefill, two tokens, then single tokens through the cache, against GPT.forward over
    the whole sequence; and the same greedy tokens past the block (slid or ring-cached)."""
    cfg = config(**options)
    model = tiny_model(2, cfg, scale=3.0)
    idx = torch.randint(0, 29, (2, 16), generator=torch.Generator().manual_seed(0))
    exact = float64_logits(model, idx, all_logits=True)  # the bound: numerics.py
    for name, make in ENGINES.items():
        engine = make(model)
        cache = engine.new_cache(2)
        chunks = [idx[:, :7], idx[:, 7:9], *[idx[:, t : t + 1] for t in range(9, 16)]]
        got = np.stack([np.asarray(engine.forward(c.tolist(), cache)) for c in chunks], axis=1)
        assert_near_exact(got, exact[:, [6, 8, *range(9, 16)]], cfg, name)
    prompts = idx[:, :4].tolist()
    tokens = [list(decode(make(model), prompts, 40, sampling=GREEDY)) for make in ENGINES.values()]
    assert all(t == tokens[0] for t in tokens)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("window", [None, pytest.param(6, marks=pytest.mark.slow)])
def test_a_one_layer_rotary_model_decodes_past_the_block_as_nanogpts_crop_loop(
    backend: str, window: int | None
) -> None:
    """The crop loop recomputes the last block_size tokens at every step; the ring cache reads each token
    once: for one layer (whose keys depend on nothing but their token) they are the same model."""
    cfg = GPTConfig(
        vocab_size=29, block_size=12, n_layer=1, n_head=4, n_embd=32, pos="rope", n_kv_head=2,
        window=window, window_pattern="S", norm="rmsnorm", mlp="relu2", qk_norm=True,
    )  # fmt: skip
    if window is not None:  # a local layer needs a full one after it
        cfg = GPTConfig(**{**cfg.to_dict(), "n_layer": 2})
    model = tiny_model(3, cfg)
    prompts = torch.randint(0, 29, (3, 4), generator=torch.Generator().manual_seed(1))
    n = 3 * cfg.block_size
    engine = ENGINES[backend](model)
    got = rows(list(decode(engine, prompts.tolist(), n, sampling=GREEDY)))
    if window is None:
        assert got == nanogpt_loop(model, prompts, n)[:, 4:].tolist()
    assert got == uncached_greedy(model, prompts, n)[:, 4:].tolist()
    assert all(len(set(row[-cfg.block_size :])) > 3 for row in got)  # not one repeated token


def uncached_greedy(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding by a full forward pass over the whole text at every step, no cache and no crop:
    past block_size, each rotary layer attends to its latest block_size (or window) positions."""
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("backend", ENGINES)
def test_a_deep_rotary_model_decodes_past_the_block_at_a_ring_caches_cost(backend: str) -> None:
    cfg = config(n_layer=3, pos="rope", window=5, window_pattern="SL", block_size=10, n_kv_head=1)
    model = tiny_model(6, cfg)
    engine = ENGINES[backend](model)
    cache = engine.new_cache(2)
    assert [c.shape[2] for c in cache.k] == [5, 10, 10]  # a local layer keeps its window only
    prompts = [[1, 2, 3], [4, 5, 6]]
    got = rows(list(decode(engine, prompts, 40, sampling=GREEDY)))
    assert got == uncached_greedy(model, torch.tensor(prompts), 40)[:, 3:].tolist()


def test_learned_positions_stop_at_the_block_and_windows_at_most_fill_it() -> None:
    model = GPT(config(window=4)).eval()
    with pytest.raises(UsageError, match="longer than the model's block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(UsageError, match="window .17. must be at most block_size"):
        config(window=17)
    with pytest.raises(UsageError, match="n_kv_head .3. must divide n_head"):
        config(n_kv_head=3)
    with pytest.raises(UsageError, match="window_pattern"):
        config(window=4, window_pattern="SXL")
    with pytest.raises(UsageError, match="unknown mlp 'geglu'"):
        config(mlp="geglu")
    assert config(n_layer=4, window=4, window_pattern="SL").layer_windows == (4, 16, 4, 16)
    assert config(n_layer=3, window=4).layer_windows == (4, 4, 16)


def test_swiglu_holds_as_many_parameters_as_gelu() -> None:
    assert config(n_embd=384, n_head=6, mlp="swiglu").d_ff == 1024
    gelu = GPT(config(n_embd=384, n_head=6, bias=False))
    swiglu = GPT(config(n_embd=384, n_head=6, bias=False, mlp="swiglu"))
    assert gelu.num_params() == swiglu.num_params()
