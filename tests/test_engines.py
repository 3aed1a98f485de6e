"""The two engines against the torch model and each other: logits, greedy tokens, sampling rules, loading."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import slow_but
from numerics import assert_near_exact, float32_bound, float64_logits
from test_decode import ENGINES, GREEDY, TINY, numpy_twin, rows, tiny_model
from threadpoolctl import threadpool_limits

from minigpt.errors import MinigptError, UsageError
from minigpt.generate import load as engines
from minigpt.generate.decode import Generation, Sampling, decode, generate, generate_uncached
from minigpt.generate.engines import kernels
from minigpt.generate.engines import numpy_engine as numpy_engine
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.generate.load import choose_backend, load_engine
from minigpt.model.build import model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.weights import for_decoding, weights_by_name
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=lambda n: f"{n}-threads")
def blas_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's threads and NumPy's BLAS threads, 1 and then 2: a parallel BLAS splits and orders its sums
    otherwise, and the tolerance must hold either way (it bounds every order)."""
    n = request.param
    torch.set_num_threads(n)
    with threadpool_limits(n, user_api="blas"):
        yield n
    torch.set_num_threads(1)


# --- one table: every model option, both engines, cached and uncached -----------------------------------


@dataclass(frozen=True)
class Case:
    bias: bool = True
    tied: bool = True
    n_head: int = 2
    block_size: int = 16
    batch: int = 1  # different prompts, one row each
    samples: int = 1  # rows continuing one prompt
    prompt_len: int = 3
    slide: int | None = None
    seed: int = 0  # of the weights and the prompts: one whose greedy text does not repeat a token
    score: str = "scaled"  # --attn-score
    n_embd: int = 32

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=37, block_size=self.block_size, n_layer=2, n_head=self.n_head, n_embd=self.n_embd,
            bias=self.bias, tie_embeddings=self.tied, attn_score=self.score,
        )  # fmt: skip


CASES = [
    Case(),  # GPT-2's options, one short prompt
    Case(bias=False, tied=False, n_head=1, batch=3, prompt_len=16, slide=1),  # prompts fill the block
    Case(tied=False, n_head=4, block_size=8, batch=2, prompt_len=21, slide=5),  # prompts longer than it
    Case(bias=False, n_head=4, block_size=32, samples=3, prompt_len=7, slide=32),  # one prefill, 3 rows
    Case(n_head=1, block_size=12, prompt_len=40),
    Case(n_head=4, block_size=24, batch=2, prompt_len=20, n_embd=192),  # products large enough to thread
    # the attention scores, the prefill over the block, then sliding and several rows
    Case(score="dot", n_head=4, batch=2, prompt_len=9, slide=3),
    Case(score="general", tied=False, n_head=4, block_size=8, batch=2, prompt_len=21, slide=5),
    Case(score="additive", bias=False, n_head=4, samples=3, prompt_len=16, slide=1, seed=1),
    Case(score="additive", n_head=2, block_size=12, batch=2, prompt_len=30, seed=1),
]


def feed_in_pieces(engine: Any, ids: torch.Tensor) -> np.ndarray:
    """Logits (B, T', V) of an engine fed a prefill, then two tokens at once, then one at a time, at the
    positions that produce them: split-1, split+1, then every later one."""
    split, T = ids.size(1) // 2, ids.size(1)
    cache = engine.new_cache(ids.size(0))
    chunks = [ids[:, :split], ids[:, split : split + 2], *[ids[:, t : t + 1] for t in range(split + 2, T)]]
    return np.stack([np.asarray(engine.forward(chunk.tolist(), cache)) for chunk in chunks], axis=1)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_both_engines_compute_gpt_forward(case: Case, blas_threads: int) -> None:
    """Both engines' float32 logits (fed a prefill, two tokens, then one at a time, and in one plain pass)
    within the float32 bound (numerics.py) of GPT.forward computed in float64, as is GPT.forward in
    float32 itself, with one thread and with two."""
    config = case.config()
    model = tiny_model(case.seed, config)
    draw = torch.Generator().manual_seed(case.seed)
    by_name = {name: make(model) for name, make in ENGINES.items()}
    ids = torch.randint(0, config.vocab_size, (max(case.batch, 2), config.block_size), generator=draw)
    exact = float64_logits(model, ids, all_logits=True)
    with torch.no_grad():
        assert_near_exact(model(ids, all_logits=True)[0].numpy(), exact, config, "GPT.forward")
    split = config.block_size // 2
    positions = [split - 1, split + 1, *range(split + 2, config.block_size)]
    for name, engine in by_name.items():
        assert_near_exact(feed_in_pieces(engine, ids), exact[:, positions], config, f"{name}, cached")
        full = np.asarray(engine.forward(ids.tolist(), None))  # no cache: the plain forward pass
        assert_near_exact(full, exact[:, -1], config, f"{name}, one pass")


FLOAT16_CACHE = {
    "torch": lambda model: TorchEngine(model, kv_cache="float16"),
    "numpy": lambda model: numpy_twin(model, kv_cache="float16"),
    "numpy-arrays": lambda model: numpy_twin(model, kernels=False, kv_cache="float16"),
}


@pytest.mark.parametrize("case", slow_but(CASES, repr(CASES[0]), repr(CASES[2]), repr(CASES[8]), ids=repr))
def test_a_float16_kv_cache_stores_rounded_keys_and_reads_them(case: Case) -> None:
    """Both engines (the NumPy one on both paths) with keys and values cached in float16, fed a prefill,
    two tokens, then one at a time. The first layer's keys and values (which no attention precedes) are
    the float32 engines' rounded to float16, bit for bit. The logits are within float32's bound of
    GPT.forward in float64 over a float16 cache (what the rounding does, computed exactly), plus half of
    what that rounding changes: float32's arithmetic lands a few keys on the other side of a float16
    rounding boundary than float64's, each then a whole float16 step away where rounding moved every key
    by up to half a step. And they are further from the float32 model than that allowance: the keys and
    values were rounded."""
    config = case.config()
    model = tiny_model(case.seed, config)
    draw = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(0, config.vocab_size, (max(case.batch, 2), config.block_size), generator=draw)
    split = config.block_size // 2
    positions = [split - 1, split + 1, *range(split + 2, config.block_size)]
    exact = float64_logits(model, ids, all_logits=True)[:, positions]
    exact16 = feed_in_pieces(TorchEngine(copy.deepcopy(model).double(), kv_cache="float16"), ids)
    change = float(np.abs(exact16 - exact).max())
    for name, make in FLOAT16_CACHE.items():
        half, full = make(model), ENGINES[name](model)
        got = feed_in_pieces(half, ids)
        assert_near_exact(got, exact16, config, f"{name}, float16 cache", slack=change / 2)
        assert np.abs(got - exact).max() > change / 2, name
        assert str(half.new_cache(1).k[0].dtype).removeprefix("torch.") == "float16", name
        h, f = half.new_cache(ids.size(0)), full.new_cache(ids.size(0))
        half.forward(ids.tolist(), h), full.forward(ids.tolist(), f)
        for mine, theirs in ((h.k[0], f.k[0]), (h.v[0], f.v[0])):
            mine, theirs = np.asarray(mine.float() if name == "torch" else mine), np.asarray(theirs)
            np.testing.assert_array_equal(mine, theirs.astype(np.float16).astype(np.float32), err_msg=name)


@pytest.mark.parametrize("head_dim", [64, 6])
def test_the_rotary_table_gives_rotarys_rows(head_dim: int) -> None:
    """`RotaryTable`: the rows `rotary` computes for any positions, bit for bit, one at a time as decoding
    asks, across the ends of its chunks, and for a prefill longer than a chunk."""
    table = numpy_engine.RotaryTable(10000.0, head_dim)
    chunk = table.CHUNK
    asks = [
        (0, 5),
        (5, 1),
        (chunk - 1, 1),
        (chunk, 1),
        (chunk - 2, 4),
        (3, 1),
        (1000, chunk + 50),
        (7 * chunk, 1),
    ]
    for start, length in asks:
        got, want = table(start, length), numpy_engine.rotary(10000.0, head_dim, start, length)
        assert got[0].shape == (length, head_dim), (start, length)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_a_float16_kv_cache_clamps_what_it_cannot_hold() -> None:
    """Keys and values past float16's largest finite value (65,504) are cached as that value, not as
    infinity, on both engines and both NumPy paths: the logits stay finite and agree within float32's
    rounding of the clamped values."""
    model = tiny_model(0, scale=50.0)
    with torch.no_grad():  # the key and value rows of c_attn: outputs around 10^6
        model.transformer.h[0].attn.c_attn.weight[TINY.n_embd :] *= 1e4
    ids = [[1, 2, 3, 4, 5]]
    logits = {}
    for name, make in FLOAT16_CACHE.items():
        engine = make(model)
        cache = engine.new_cache(1)
        engine.forward([ids[0][:3]], cache)
        steps = [np.asarray(engine.forward([[t]], cache), dtype=np.float64) for t in ids[0][3:]]
        keys = np.asarray(cache.k[0][0, :, :5].float() if name == "torch" else cache.k[0][0, :, :5])
        assert np.isfinite(keys).all() and np.abs(keys).max() == 65504.0, name
        logits[name] = np.stack(steps)
        assert np.isfinite(logits[name]).all(), name
    np.testing.assert_allclose(logits["numpy"], logits["numpy-arrays"], rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_both_engines_decode_the_same_greedy_tokens(case: Case) -> None:
    """The same greedy tokens on both engines, cached and uncached, inside the block and through several
    slides past it."""
    config = case.config()
    model = tiny_model(case.seed, config)
    draw = torch.Generator().manual_seed(case.seed)
    by_name = {name: make(model) for name, make in ENGINES.items()}
    # the logits test's ids come first from the seed, so the prompts are those its seed was picked for
    torch.randint(0, config.vocab_size, (max(case.batch, 2), config.block_size), generator=draw)
    prompts = torch.randint(0, config.vocab_size, (case.batch, case.prompt_len), generator=draw).tolist()
    n = 3 * config.block_size + 5
    options = dict(num_samples=case.samples, slide=case.slide, sampling=GREEDY)
    tokens = {}
    for name, engine in by_name.items():
        tokens[name] = list(decode(engine, prompts, n, **options))
        assert tokens[name] == generate_uncached(engine, prompts, n, **options), name
    assert tokens["numpy"] == tokens["torch"] == tokens["numpy-arrays"]
    assert len(tokens["torch"]) == n and len(tokens["torch"][0]) == max(case.batch, case.samples)
    last = rows(tokens["torch"][-config.block_size :])
    assert all(len(set(row)) > 3 for row in last)  # non-trivial sequences


@pytest.mark.parametrize("backend", ENGINES)
def test_a_one_row_prefill_serves_every_row(backend: str) -> None:
    model = tiny_model(3)
    engine = ENGINES[backend](model)
    cache = engine.new_cache(3)
    prompt, nxt = [[4, 8, 15, 16]], [[1], [2], [3]]
    first = np.asarray(engine.forward(prompt, cache))
    got = np.asarray(engine.forward(nxt, cache))
    want = float64_logits(model, torch.tensor([prompt[0] + row for row in nxt]))
    alone = float64_logits(model, torch.tensor(prompt))
    assert first.shape == (3, TINY.vocab_size)
    assert_near_exact(first, np.repeat(alone, 3, axis=0), TINY, "the prefill")
    assert_near_exact(got, want, TINY, "the next tokens")
    with pytest.raises(UsageError, match="rows"):
        engine.forward([[1], [2]], cache)


# --- the weights' layout, chosen at load: the same logits in every form -------------------------------

LAYOUT_CONFIGS = {
    "gpt2": GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32),
    "modern": GPTConfig(
        vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=32, pos="rope", norm="rmsnorm",
        mlp="swiglu", tie_embeddings=False, qk_norm=True, n_kv_head=2, window=5, window_pattern="SL",
    ),
    "relu2": GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, mlp="relu2", bias=False),
}  # fmt: skip
# the attention scores with their own maps (held as the file has them in every layout), over grouped
# queries, QK-norm, rotary positions and a local window
LAYOUT_CONFIGS |= {
    f"modern-{score}": replace(LAYOUT_CONFIGS["modern"], attn_score=score)
    for score in ("general", "additive")
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_a_layout_chosen_at_load_gives_the_same_logits(name: str) -> None:
    config = LAYOUT_CONFIGS[name]
    model = tiny_model(1, config, scale=3.0)
    tensors = {k: v.detach().numpy() for k, v in model_tensors(model).items()}
    ids = torch.randint(
        0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want = model(ids, all_logits=True)[0].numpy()
    split = config.block_size // 2
    positions = [split - 1, split + 1, *range(split + 2, config.block_size)]
    for layout in ("output-major", "input-major", "auto"):
        for engine in (NumpyEngine(config, tensors, layout=layout), TorchEngine(model, layout=layout)):
            label = f"{engine.name} {layout}"
            assert engine.layout == layout or layout == "auto", label
            c_attn = engine.weights.h[0].attn.c_attn
            assert c_attn.input_major == (engine.layout == "input-major"), label
            assert c_attn.weight.shape[0 if c_attn.input_major else 1] == config.n_embd, label  # the inputs
            if config.mlp == "swiglu":  # the gate and the up-projection: one product
                assert engine.weights.h[0].mlp.fused_gate and engine.weights.h[0].mlp.c_gate is None
            np.testing.assert_allclose(
                feed_in_pieces(engine, ids), want[:, positions], rtol=1e-4, atol=1e-4, err_msg=label
            )
            every = np.asarray(engine.forward(ids.tolist(), engine.new_cache(2), every_position=True))
            np.testing.assert_allclose(every, want, rtol=1e-4, atol=1e-4, err_msg=label)
            logp = engine.log_probs(engine.forward(ids.tolist(), None))
            assert logp.dtype == np.float64 and logp.shape == (2, config.vocab_size)
            expected = torch.log_softmax(torch.from_numpy(want[:, -1]).double(), -1).numpy()
            np.testing.assert_allclose(logp, expected, atol=1e-4, err_msg=label)
    # the file's tensors are what they were: the layouts are the engine's copies
    assert all(np.array_equal(v, model_tensors(model)[k].numpy()) for k, v in tensors.items())


@pytest.mark.parametrize("name", ["gpt2", "modern"])  # a tied head (the embedding table) and an untied one
@pytest.mark.parametrize("layout", ["output-major", "input-major"])
def test_the_numpy_engine_holds_its_arrays_in_one_buffer(name: str, layout: str) -> None:
    config = LAYOUT_CONFIGS[name]
    tensors = {k: v.detach().numpy() for k, v in model_tensors(tiny_model(1, config, scale=3.0)).items()}
    engine = NumpyEngine(config, tensors, layout=layout)
    found: dict[int, np.ndarray] = {}
    numpy_engine._collect((engine.weights, engine._head), found)  # every array, matrices or not
    arrays = list(found.values())
    assert {a.dtype for a in arrays} == {np.dtype(np.float32)} and len(arrays) > 4 * config.n_layer
    assert len({id(a.base) for a in arrays}) == 1 and arrays[0].base is not None
    assert all(a.ctypes.data % 64 == 0 and a.flags.c_contiguous for a in arrays)
    if config.tie_embeddings and layout == "output-major":  # one copy serves the lookups and the head
        assert engine.weights.wte is engine._head.weight
    # the same values as the tree before packing: the logits of the engine's functions over each agree
    fused = for_decoding(weights_by_name(config, tensors), np.concatenate)
    tree = fused if layout == "output-major" else for_decoding(fused, np.concatenate, numpy_engine.transposed)
    ids = np.arange(12).reshape(2, 6) % config.vocab_size
    before = numpy_engine.head(
        tree, numpy_engine._head(tree, layout == "input-major"), numpy_engine.transformer(tree, ids, None)
    )
    after = numpy_engine.head(
        engine.weights, engine._head, numpy_engine.transformer(engine.weights, ids, None)
    )
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_cache", ["float32", "float16"])
def test_the_numpy_engines_cache_is_one_buffer_of_separate_layers(kv_cache: str) -> None:
    config = LAYOUT_CONFIGS["modern"]  # sliding-window layers: buffers of two capacities
    tensors = {k: v.detach().numpy() for k, v in model_tensors(tiny_model(1, config)).items()}
    cache = NumpyEngine(config, tensors, kv_cache=kv_cache).new_cache(3)
    buffers = cache.k + cache.v
    assert len({id(b.base) for b in buffers}) == 1 and buffers[0].base is not None
    assert all(b.ctypes.data % 64 == 0 and b.flags.c_contiguous and not b.any() for b in buffers)
    assert [b.shape[2] for b in cache.k] == [min(w, config.block_size) for w in config.layer_windows]
    for i, b in enumerate(buffers):  # no two layers overlap: each holds what was written to it
        b[...] = i
    assert [int(b.min()) for b in buffers] == [int(b.max()) for b in buffers] == list(range(len(buffers)))
    # the kernels' view of it: the one buffer (float16 as its bits), where each layer starts, the rows
    flat, slots, rows = cache.kernel
    assert rows == 3 and flat.dtype == (np.uint16 if kv_cache == "float16" else np.float32)
    for layer, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
        for start, buffer in ((slots[layer, 0], k), (slots[layer, 1], v)):
            np.testing.assert_array_equal(
                flat[start : start + buffer.size], buffer.reshape(-1).view(flat.dtype)
            )
        assert slots[layer, 2] == k.shape[2]


@pytest.mark.slow
def test_the_layout_and_threads_come_from_the_engine_loading_a_run(tmp_path: Path, monkeypatch) -> None:
    run = save(tmp_path / "run", tiny_model(8))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    greedy = []
    for backend in ("numpy", "torch"):
        engine, _ = load_engine(run, backend, "cpu")
        assert engine.layout in ("output-major", "input-major")  # type: ignore[attr-defined]
        tuner = engine.tuner  # type: ignore[attr-defined]
        assert len(tuner.candidates) >= 1 and tuner.chosen((1, True)) in (None, *tuner.candidates)
        greedy.append(list(decode(engine, [[1, 2, 3]], 20, sampling=GREEDY)))  # trials ran on every count
        assert tuner.chosen((1, True)) in tuner.candidates
        fixed, _ = load_engine(run, backend, "cpu", threads=1)
        assert fixed.tuner.candidates == [1]  # type: ignore[attr-defined]
        assert list(decode(fixed, [[1, 2, 3]], 20, sampling=GREEDY)) == greedy[-1]
    torch.set_num_threads(1)
    assert greedy[0] == greedy[1]


# --- one rule set: sampling, held equal across both engines ---------------------------------------------

PROBS = [0.05, 0.5, 0.15, 0.3]  # ranked: 1, 3, 2, 0
KEPT = [  # (top_k, top_p, the tokens that can be drawn)
    (None, None, {0, 1, 2, 3}),
    (2, None, {1, 3}),
    (3, None, {1, 2, 3}),
    (None, 0.5, {1}),  # token 1 alone reaches 0.5
    (None, 0.7, {1, 3}),
    (None, 0.81, {1, 2, 3}),
    (None, 1.0, {0, 1, 2, 3}),
    (2, 0.99, {1, 3}),  # they compose: top-k first, then top-p
    (3, 0.6, {1, 3}),
]


# --- rows at different positions, stepped together (a server's joined requests) ------------------------


def _prefilled(engine: Any, prompt: list[int]) -> Any:
    cache = engine.new_cache(1)
    engine.forward([prompt], cache)
    return cache


@pytest.mark.slow
@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_rows_at_different_positions_step_together(name: str, backend: str) -> None:
    """Three requests prefilled alone (3, 9 and 1 tokens) and joined into one cache (`gather`) take one
    token a row a step: inside the block, each row's logits are the float64 model's over its own text;
    a rotary model goes on past the block (its rings wrapping at different steps for different rows) with
    each row as it decodes alone (the kernels: bit for bit), over every architecture option and score."""
    config = LAYOUT_CONFIGS[name]
    model = tiny_model(1, config)
    engine = ENGINES[backend](model)
    draw = np.random.default_rng(0)
    prompts = [draw.integers(0, config.vocab_size, n).tolist() for n in (3, 9, 1)]
    steps = draw.integers(0, config.vocab_size, (3, 16 if config.pos == "rope" else 6)).tolist()
    cache = engine.gather([(_prefilled(engine, p), 0, 1) for p in prompts])
    alone = [_prefilled(engine, p) for p in prompts]
    for t in range(len(steps[0])):
        got = np.asarray(engine.forward([[row[t]] for row in steps], cache))
        for r, (prompt, row) in enumerate(zip(prompts, steps, strict=True)):
            solo = np.asarray(engine.forward([[row[t]]], alone[r]))[0]
            text = prompt + row[: t + 1]
            if len(text) <= config.block_size:
                exact = float64_logits(model, torch.tensor([text]))[0]
                assert_near_exact(got[r], exact, config, f"row {r}, step {t}")
            elif backend == "numpy" and engine.kernels:
                np.testing.assert_array_equal(got[r], solo)
            else:  # two float32 computations of the same logits, each within the bound of the exact ones
                assert_near_exact(
                    got[r], solo, config, f"row {r}, step {t}", slack=float32_bound(config, solo)
                )
    assert cache.positions.tolist() == [len(p) + len(row) for p, row in zip(prompts, steps, strict=True)]


def rng_state(rng: Any) -> Any:
    return rng.get_state().tolist() if isinstance(rng, torch.Generator) else rng.bit_generator.state


@pytest.mark.slow
@pytest.mark.parametrize("backend", ENGINES)
def test_sampling_rules(backend: str) -> None:
    engine = ENGINES[backend](tiny_model(6))
    logits_of = torch.from_numpy if backend == "torch" else np.asarray

    def draws(probs: list[float], n: int = 4000, seed: int = 0, **kw: Any) -> list[int]:
        logits = logits_of(np.log(np.tile(np.array(probs, dtype=np.float32), (n, 1))))
        kw = {"temperature": 1.0, "top_k": None, "top_p": None, **kw}
        return engine.sample(logits, rng=engine.rng(seed), **kw)

    # top-k keeps exactly k tokens, ties included; top-p the smallest set reaching p
    for top_k, top_p, kept in KEPT:
        assert set(draws(PROBS, top_k=top_k, top_p=top_p)) == kept, (top_k, top_p)
    assert len(set(draws([0.25, 0.25, 0.25, 0.25], top_k=2))) == 2
    # frequencies follow the renormalised distribution
    assert abs(draws(PROBS, 20000, seed=1, top_k=2).count(1) / 20000 - 0.5 / 0.8) < 0.02
    # temperature 0 is argmax and never touches the generator; a cold temperature is nearly argmax
    random = np.random.default_rng(0).standard_normal((50, 10)).astype(np.float32)
    rng = engine.rng(3)
    before = rng_state(rng)
    assert engine.sample(logits_of(random), 0.0, None, None, rng) == random.argmax(-1).tolist()
    assert rng_state(rng) == before
    cold = engine.sample(logits_of(np.tile(random, (50, 1))), 0.05, None, None, rng)
    assert np.mean(np.array(cold) == np.tile(random.argmax(-1), 50)) > 0.9
    # any temperature a user can type: a subnormal one (float32's, float64's) is argmax, never NaN
    for tiny in (1e-40, 1e-320):
        for top_k, top_p in ((None, None), (3, 0.5)):
            assert engine.sample(logits_of(random), tiny, top_k, top_p, rng) == random.argmax(-1).tolist()
    # top-k 1 is greedy; a seed reproduces its text; greedy ignores the seed
    prompt = [[1, 2]]

    def run(sampling: Sampling) -> list[list[int]]:
        return list(decode(engine, prompt, 40, num_samples=3, sampling=sampling))

    greedy = run(Sampling(temperature=0.0, seed=1))
    assert run(Sampling(temperature=0.0, seed=2)) == greedy
    assert run(Sampling(temperature=1.5, top_k=1, seed=0)) == run(Sampling(temperature=1.5, top_k=1, seed=1))
    assert run(Sampling(temperature=1.5, top_k=1)) == greedy
    sampled = Sampling(temperature=1.0, top_p=0.95, seed=5)
    assert run(sampled) == run(sampled) != run(Sampling(temperature=1.0, top_p=0.95, seed=6))


# --- the torch model behind its engine ------------------------------------------------------------------


def test_cached_forward_matches_full_forward() -> None:
    model = tiny_model(scale=1.0)
    idx = torch.randint(0, TINY.vocab_size, (2, 12))
    cache = model.new_cache(2)
    with torch.no_grad():
        full, _ = model(idx, all_logits=True)
        first, _ = model(idx[:, :7], kv_cache=cache, all_logits=True)
        second, _ = model(idx[:, 7:9], kv_cache=cache, all_logits=True)  # several new tokens at once
        steps = [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(9, 12)]
    torch.testing.assert_close(torch.cat([first, second, torch.stack(steps, 1)], 1), full)


@pytest.mark.parametrize(("bias", "tied"), [(True, True), (False, False)])
def test_the_weight_tree_gives_the_forward_of_the_modules(bias: bool, tied: bool) -> None:
    config = GPTConfig(
        vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=bias, tie_embeddings=tied
    )
    model = tiny_model(config=config, scale=10.0)  # activations of order 1: GELU's tanh form shows
    weights = model.weights()
    assert weights.h[1].mlp.c_fc.weight is model.transformer.h[1].mlp.c_fc.weight
    assert (weights.lm_head is weights.wte) == tied and (weights.ln_f.bias is None) == (not bias)
    idx = torch.randint(0, config.vocab_size, (3, 10))
    want_cache, got_cache = model.new_cache(3), model.new_cache(3)
    with torch.no_grad():
        model(idx[:, :6], kv_cache=want_cache)
        model(idx[:, :6], kv_cache=got_cache, weights=weights)
        for t in range(6, 10):
            want, _ = model(idx[:, t : t + 1], kv_cache=want_cache)
            got, _ = model(idx[:, t : t + 1], kv_cache=got_cache, weights=weights)
            assert torch.equal(got, want)
    assert got_cache.pos == want_cache.pos == 10
    for got, want in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        assert torch.equal(got, want)


def test_the_cache_and_engine_follow_the_model_dtype() -> None:
    model = tiny_model().to(torch.bfloat16)
    cache = model.new_cache(2)
    assert [(k.dtype, k.shape) for k in cache.k] == [(torch.bfloat16, (2, 2, 16, 16))] * 2
    engine = TorchEngine(model)
    assert (engine.name, engine.device, engine.dtype) == ("torch", "cpu", "bfloat16")
    assert len(list(decode(engine, [[1, 2, 3]], 20, sampling=GREEDY))) == 20


def test_generation_drives_either_engine_to_the_same_greedy_text() -> None:
    tok = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,;:!?'\n") + ["-"])
    model = tiny_model(7, GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32))
    texts = []
    for make in ENGINES.values():
        engine = make(model)
        gen = Generation(engine, tok, tok.encode("hello"), max_new_tokens=50, temperature=0.0, num_samples=2)
        texts.append([s.text for s in generate(engine, tok, "hello", max_new_tokens=50, temperature=0)])
        assert [e.sample for e in gen.events()] and len(gen.samples) == 2
    assert all(t == texts[0] for t in texts) and len(texts[0][0]) == 50


# --- loading and the choice of engine -------------------------------------------------------------------


def save(path: Path, model: GPT) -> Path:
    RunDir(path).save(model, CharTokenizer([chr(97 + i) for i in range(26)] + list(" .,;:!?'\n-A")), extra={})
    return path


def test_load_engine_reads_a_run_and_names_what_is_wrong(tmp_path: Path) -> None:
    model = tiny_model(8)
    run = save(tmp_path / "run", model)
    engine, tok = load_engine(run, "numpy")
    torch_engine, _ = load_engine(run, "torch", "cpu", "auto")
    assert tok.vocab_size == 37 and engine.block_size == 16 and torch_engine.dtype == "float32"
    greedy = [list(decode(e, [[1, 2, 3]], 20, sampling=GREEDY)) for e in (engine, torch_engine)]
    assert greedy[0] == greedy[1] == list(decode(TorchEngine(model), [[1, 2, 3]], 20, sampling=GREEDY))

    config = json.loads((run / "config.json").read_text())
    config["model"]["n_embd"] = 64
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(MinigptError, match="does not match its config.json"):
        load_engine(run, "numpy")

    run = save(tmp_path / "truncated", model)
    data_bytes = (run / RunDir.WEIGHTS).read_bytes()
    (run / RunDir.WEIGHTS).write_bytes(data_bytes[: len(data_bytes) // 2])
    with pytest.raises(MinigptError, match="corrupt"):
        load_engine(run, "numpy")

    run = save(tmp_path / "bf16", model.to(torch.bfloat16))
    with pytest.raises(MinigptError, match="NumPy cannot read.*--backend torch"):
        load_engine(run, "numpy")
    assert choose_backend("auto", "auto", "auto", weights=run / RunDir.WEIGHTS) == "torch"
    with pytest.raises(UsageError, match="unknown backend"):
        load_engine(run, "jax")


def test_choose_backend(monkeypatch) -> None:
    monkeypatch.setattr(engines, "accelerator_visible", lambda: False)
    assert choose_backend("auto", "auto", "auto") == "numpy"
    assert choose_backend("auto", "cpu", "float32") == "numpy"
    assert choose_backend("auto", "cpu", "bfloat16") == "torch"
    assert choose_backend("auto", "auto", "auto", explain=True) == "torch"
    assert choose_backend("torch", "cpu", "float32") == "torch"
    monkeypatch.setattr(engines, "accelerator_visible", lambda: True)
    assert choose_backend("auto", "auto", "auto") == "torch"  # torch decides between the GPU and the CPU
    assert choose_backend("auto", "cpu", "auto") == "numpy"
    assert choose_backend("auto", "cuda", "auto") == "torch"
    for device, dtype, explain, culprit in [
        ("cuda", "auto", False, "--device cuda"),
        ("cpu", "bfloat16", False, "--dtype bfloat16"),
        ("auto", "auto", True, "--explain"),
    ]:
        with pytest.raises(UsageError, match=f"drop {culprit}"):
            choose_backend("numpy", device, dtype, explain=explain)


def test_accelerator_visible_respects_hidden_gpus(monkeypatch) -> None:
    if sys.platform != "darwin":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        assert engines.accelerator_visible() is False


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_cpu_generation_never_imports_torch(tmp_path: Path, quantize: str) -> None:
    run = save(tmp_path / "run", tiny_model(9))
    # numba's cache holds these kernels: the command loads them (where it would start compiling them)
    kernels.compile_entries(kernels.missing(kernels.entries(quantize, "float16")))
    code = (
        "import sys\n"
        "from minigpt.cli.main import main\n"
        f"sys.argv = ['minigpt', 'generate', 'abc', '-m', {str(run)!r}, '-n', '30', '--seed', '1', '--device', 'cpu', '--quantize', {quantize!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
        "import minigpt\n"
        "print(minigpt.__file__, file=sys.stderr)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == 30 and "numpy kernels on cpu" in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-2] == "no torch" and lines[-1] == str(ROOT / "minigpt" / "__init__.py")  # this checkout
