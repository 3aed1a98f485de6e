"""The NumPy engine's compiled one-token step (minigpt/generate/engines/kernels.py): when it runs, what it computes
against the array path and the float64 reference, its threads, and the engine without it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numba
import numpy as np
import pytest
import torch
from numerics import assert_near_exact, float32_bound, float64_logits
from test_decode import tiny_model
from test_engines import save

from minigpt.errors import UsageError
from minigpt.generate.engines import kernels
from minigpt.generate.engines.compiling import BACKGROUND
from minigpt.generate.engines.numpy_engine import NumpyEngine, banded, int8_linear, quantized_bands
from minigpt.generate.engines.tuning import blas_tuner
from minigpt.generate.load import load_engine
from minigpt.model.build import model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.presets import model_config
from minigpt.model.weights import LinearWeights

# shapes whose products do not split evenly into the kernels' 16-row tasks, every option they compute
SHAPE = dict(vocab_size=37, block_size=12, n_layer=2, n_head=5, n_embd=40)
CONFIGS = {
    "gpt2": GPTConfig(**SHAPE),
    "modern": model_config(arch="modern", **SHAPE),
    "gqa-qknorm-window-relu2": model_config(
        arch="modern", **{**SHAPE, "n_head": 4, "n_embd": 48}, n_kv_head=2, qk_norm=True, mlp="relu2",
        window=5, window_pattern="SL",
    ),
    "value-embeds-skips-cap-dot": model_config(
        arch="modern", **{**SHAPE, "n_layer": 4}, value_embeds=True, skips=True, logit_cap=20.0,
        attn_score="dot",
    ),
    "no-bias-untied": GPTConfig(**SHAPE, bias=False, tie_embeddings=False),
}  # fmt: skip


def engine_of(config: GPTConfig, seed: int = 0, **kw: object) -> tuple[NumpyEngine, torch.nn.Module]:
    model = tiny_model(seed, config, scale=3.0)
    tensors = {k: v.detach().numpy() for k, v in model_tensors(model).items()}
    return NumpyEngine(config, tensors, **kw), model


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kernel_steps_compute_the_forward_and_fill_the_cache_as_the_array_path(
    name: str, threads: int
) -> None:
    """Three rows fed a prefill, then one token at a time past the block (a ring cache wraps, a learned
    position model stops at it): logits within the float32 bound of GPT.forward in float64, and the
    cache each path leaves behind the same."""
    config = CONFIGS[name]
    fast, model = engine_of(config, threads=threads)
    slow, _ = engine_of(config, threads=threads, kernels=False)
    assert fast.kernels and not slow.kernels
    steps = config.block_size - 4 if config.pos == "learned" else 2 * config.block_size
    ids = torch.randint(0, config.vocab_size, (3, 4 + steps), generator=torch.Generator().manual_seed(2))
    caches = fast.new_cache(3), slow.new_cache(3)
    for engine, cache in zip((fast, slow), caches, strict=True):
        engine.forward(ids[:, :4].tolist(), cache)
    for t in range(4, 4 + steps):
        got = [
            np.asarray(e.forward(ids[:, t : t + 1].tolist(), c))
            for e, c in zip((fast, slow), caches, strict=True)
        ]
        if t < config.block_size:  # GPT.forward sees the whole sequence only inside the block
            exact = float64_logits(model, ids[:, : t + 1])
            assert_near_exact(got[0], exact, config, f"{name}, kernels, position {t}")
        # each path within the bound of the exact logits, so the two within twice it of each other
        bound = 2 * float32_bound(config, got[1])
        assert np.abs(got[0] - got[1]).max() <= bound, f"{name}: the paths differ at position {t}"
    for mine, theirs in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_prefill_through_the_kernels_is_the_forward_of_its_tokens(name: str) -> None:
    """Prompts through the kernels as one call, each token attending to its row's slots up to its own
    position: every position's logits within the float32 bound of GPT.forward in float64, a second prefill
    after the first, one row of an empty cache serving three (samples of one prompt); where the ring
    would wrap or the tokens pass `kernel_rows`, the array path. Each way, the cache and the next step
    the array path's."""
    config = CONFIGS[name]
    fast, model = engine_of(config)
    slow, _ = engine_of(config, kernels=False)
    fast.kernel_rows = 64  # as if measured: the kernels' products win up to 64 rows
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    shortest = min(fast.new_cache(1).capacity)
    for rows, parts in ((3, (4, 3)), (1, (4,)), (2, (9,))):
        caches = fast.new_cache(3 if rows == 1 else rows), slow.new_cache(3 if rows == 1 else rows)
        start = 0
        for new in parts:
            idx = ids[:rows, start : start + new]
            compiled = start + new <= shortest
            assert fast._compiled_prefill(idx.numpy(), caches[0]) is compiled, (name, rows, start, new)
            got, want = (
                e.forward(idx.tolist(), c, every_position=True)
                for e, c in zip((fast, slow), caches, strict=True)
            )
            exact = float64_logits(model, ids[:rows, : start + new], all_logits=True)[:, start:]
            assert_near_exact(got[:rows], exact, config, f"{name}, rows {rows}, positions {start}+{new}")
            assert got.shape == want.shape == (len(caches[0].k[0]), new, config.vocab_size)
            start += new
        for mine, theirs in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
        nxt = [[1]] * len(caches[0].k[0])
        step = [np.asarray(e.forward(nxt, c)) for e, c in zip((fast, slow), caches, strict=True)]
        assert np.abs(step[0] - step[1]).max() <= 2 * float32_bound(config, step[1]), name
    fast.kernel_rows = 0  # BLAS's products won at every probe: compiled up to the smallest probe only
    assert fast._compiled_prefill(np.zeros((2, 4), dtype=np.int64), fast.new_cache(2))
    assert not fast._compiled_prefill(np.zeros((3, 6), dtype=np.int64), fast.new_cache(3))


@pytest.mark.parametrize("kernels_on", [True, False])
def test_a_token_outside_the_vocabulary_is_refused_not_read_past_the_table(kernels_on: bool) -> None:
    """The compiled step indexes the embedding table without NumPy's bounds checks, so it checks each id
    itself; the array path refuses negative ids, which NumPy would take from the end of the table: ids
    past the vocabulary or negative raise IndexError on both paths, and the cache stays where it was."""
    config = CONFIGS["gpt2"]
    engine, _ = engine_of(config, kernels=kernels_on)
    assert engine.kernels is kernels_on
    cache = engine.new_cache(2)
    engine.forward([[1, 2], [3, 4]], cache)
    for bad in ([[config.vocab_size], [1]], [[1], [-1]]):
        with pytest.raises(IndexError):
            engine.forward(bad, cache)
        assert cache.pos == 2


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", ["gpt2", "modern"])
def test_batched_steps_by_tiles_compute_what_steps_by_rows_compute(name: str, quantize: str) -> None:
    """Five rows (one past a tile of four, so the last four rows are tiled again) through every matrix
    by tiles (rows of any length: `tile_from` 0; the head's 37 outputs end past the last tile of four
    weight rows) and by rows: each within the float32 bound of the other, and of the exact logits in
    float32; the caches they fill equal."""
    config = CONFIGS[name]
    tiles, model = engine_of(config, quantize=quantize, tile_from=0)
    rows, _ = engine_of(config, quantize=quantize, tile_from=None)
    assert tiles.tile_from == 0 and rows.tile_from is None
    ids = torch.randint(0, config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(3))
    caches = tiles.new_cache(5), rows.new_cache(5)
    for engine, cache in zip((tiles, rows), caches, strict=True):
        engine.forward(ids[:, :4].tolist(), cache)
    for t in range(4, 9):
        got = [e.forward(ids[:, t : t + 1].tolist(), c) for e, c in zip((tiles, rows), caches, strict=True)]
        if quantize == "none":
            assert_near_exact(got[0], float64_logits(model, ids[:, : t + 1]), config, f"{name}, tiles, {t}")
        assert np.abs(got[0] - got[1]).max() <= 2 * float32_bound(config, got[1]), f"{name} at {t}"
    for mine, theirs in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def test_a_batch_takes_the_tiling_measured_for_its_width() -> None:
    """Tiles chosen per batch width (TILE_ROWS): 5 rows step as the 8-row answer says (here never by
    tiles), 16 rows as the 16-row answer says (every matrix by tiles), the same numbers, bit for bit, as
    an engine that tiles that way for every batch."""
    config = CONFIGS["gpt2"]
    mixed, _ = engine_of(config, tile_from=None)
    mixed._use_tiles({8: None, 16: 0})
    ids = torch.randint(0, config.vocab_size, (16, 5), generator=torch.Generator().manual_seed(4)).tolist()
    for rows, tile_from in ((5, None), (16, 0)):
        alike, _ = engine_of(config, tile_from=tile_from)
        got = []
        for engine in (mixed, alike):
            cache = engine.new_cache(rows)
            engine.forward([row[:4] for row in ids[:rows]], cache)
            got.append(engine.forward([row[4:] for row in ids[:rows]], cache))
        np.testing.assert_array_equal(got[0], got[1])


def test_the_engine_measures_where_tiles_pay_and_remembers_it(monkeypatch) -> None:
    """'auto' times steps of eight rows, and of sixteen, with tiles never, or from each input width the
    model has, keeps the fastest for each, and a later load reads the answers instead of timing again."""
    from minigpt.generate.engines import numpy_engine as engine_module

    timed: list[list[str]] = []
    real = engine_module.best_times

    def spy(runs, *args, **kw):
        timed.append(list(runs))
        return real(runs, *args, **kw)

    monkeypatch.setattr(engine_module, "best_times", spy)
    config = replace(CONFIGS["gpt2"], n_embd=55)  # a model of its own: no answer kept for it yet
    for _ in range(4):
        engine, _ = engine_of(config)
        assert set(engine.tiles) == {8, 16} and set(engine.tiles.values()) <= {None, 55, 220}
        assert engine.tile_from == engine.tiles[8]
        assert engine.kernel_rows in (0, *engine_module.PREFILL_PROBES)
    probes = [[f"{way} {rows}" for rows in engine_module.PREFILL_PROBES for way in ("kernels", "numpy")]]
    assert timed == ([["rows", "tiles from 55", "tiles from 220"]] * 2 + probes) * 3
    with pytest.raises(UsageError, match="unknown tile_from 'sometimes'"):
        engine_of(config, tile_from="sometimes")


# a model whose every width is a multiple of 16: its blocks are float32 bands, which may prefetch
BANDED = replace(CONFIGS["gpt2"], n_embd=48, n_head=4)


def test_the_engine_times_prefetch_distances_per_batch_width_and_remembers_them(monkeypatch) -> None:
    """'auto' times steps of 1, 2, 4 and 8 rows with each of PREFETCHES; on faked timings in which
    asking for nothing wins at one row and 2k/16k at two rows or more, it keeps each width's fastest (a
    step of three rows asks as two rows' answer says; sixteen rows and a prefill as eight's), and later
    loads read the answers: three loads time them, the fourth does not."""
    from minigpt.generate.engines import numpy_engine as engine_module

    widths: list[int] = []
    real = engine_module.best_times

    def fake(runs, *args, **kw):
        if list(runs) != list(kernels.PREFETCHES):
            return real(runs, *args, **kw)
        rows = engine_module.FETCH_ROWS[len(widths) % len(engine_module.FETCH_ROWS)]
        widths.append(rows)
        winner = "none" if rows == 1 else "2k/16k"
        return {name: 1.0 if name == winner else 2.0 for name in runs}

    monkeypatch.setattr(engine_module, "best_times", fake)
    for _ in range(4):
        engine, _ = engine_of(BANDED)
        assert engine.prefetch == {1: (0, 0), 2: (2048, 16384), 4: (2048, 16384), 8: (2048, 16384)}
    assert widths == [1, 2, 4, 8] * 3
    asked = {rows: tuple(args[3][0, 9:]) for rows, args in engine._model_args.items()}
    assert asked == {1: (0, 0), 2: (2048, 16384), 4: (2048, 16384), 8: (2048, 16384), 16: (2048, 16384)}
    assert engine_module._at(engine._model_args, 3) is engine._model_args[2]
    assert tuple(engine._prefill_args[3][0, 9:]) == (2048, 16384)


def test_a_prefetch_distance_given_or_set_in_the_environment_is_used_untimed(monkeypatch) -> None:
    """`prefetch` names a distance for every batch, else MINIGPT_PREFETCH does, untimed; one that is
    neither a name nor two byte distances in bounds is refused, naming the variable; models whose
    blocks are not float32 bands (int8, widths not multiples of 16) have nothing to time and ask for
    nothing."""
    from minigpt.generate.engines import numpy_engine as engine_module

    timed: list[list[str]] = []
    real = engine_module.best_times
    monkeypatch.setattr(
        engine_module, "best_times", lambda runs, *a, **kw: timed.append(list(runs)) or real(runs, *a, **kw)
    )
    assert set(engine_of(BANDED, prefetch="4k/32k")[0].prefetch.values()) == {(4096, 32768)}
    monkeypatch.setenv(engine_module.PREFETCH_ENV, "1024, 0")
    assert set(engine_of(BANDED)[0].prefetch.values()) == {(1024, 0)}
    assert set(engine_of(BANDED, prefetch="2k")[0].prefetch.values()) == {(2048, 0)}
    for bad in ("far", "0,64", "64,2000000", "1,2,3", "-64,0"):
        monkeypatch.setenv(engine_module.PREFETCH_ENV, bad)
        with pytest.raises(UsageError, match="unknown prefetch distance .*MINIGPT_PREFETCH"):
            engine_of(BANDED)
    monkeypatch.delenv(engine_module.PREFETCH_ENV)
    for config, quantize in ((BANDED, "int8"), (CONFIGS["gpt2"], "none")):
        assert set(engine_of(config, quantize=quantize)[0].prefetch.values()) == {(0, 0)}
    assert not any(names == list(kernels.PREFETCHES) for names in timed)


def test_asking_for_weights_ahead_changes_no_bit_of_a_product() -> None:
    """A product by bands over 37 inputs (an odd count: a pass's last input alone) at 1 to 9 rows, asking
    for nothing, for the near line, for both, at each of PREFETCHES and at other distances: the same
    bits (a request moves no value)."""
    rng = np.random.default_rng(3)
    layer = banded(LinearWeights(rng.standard_normal((48, 37), dtype=np.float32), None))
    x = rng.standard_normal((9, 37), dtype=np.float32)
    for rows in range(1, 10):
        want = kernels.matvec(layer, x[:rows], None, (0, 0))
        for ahead in [*kernels.PREFETCHES.values(), (64, 0), (192, 4096)]:
            np.testing.assert_array_equal(kernels.matvec(layer, x[:rows], None, ahead), want)


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("biased", [True, False])
def test_a_layer_held_as_bands_computes_its_product_and_a_row_the_same_bits_in_any_batch(
    quantize: str, biased: bool
) -> None:
    """A linear layer over 37 inputs held as bands: 48 outputs (three bands; 37, odd: a pass's last input
    alone), or int8 bands of 45 outputs (the last band padded) over 64 padded inputs (two blocks of 32),
    through 1 to 21 rows (passes of eight, four, two and one rows, a batch's last rows summed again as
    part of its last pass): within float32's bound of the float64 product of the same weights (n_in units
    of rounding of the sum of |x w|) by the same inputs (int8: the activations as `_quantize` rounds
    them), and each row's outputs the same bits as that row alone."""
    rng = np.random.default_rng(0)
    n_out = 45 if quantize == "int8" else 48
    w = rng.standard_normal((n_out, 37), dtype=np.float32)
    layer = LinearWeights(w, rng.standard_normal(n_out, dtype=np.float32) if biased else None)
    x = rng.standard_normal((21, 37), dtype=np.float32)
    if quantize == "int8":
        layer = int8_linear(layer)
        bands = quantized_bands(layer)
        assert bands.weight.shape == (3, 16, kernels.LANES, 4) and bands.weight.dtype == np.uint8
        xq, xs, _ = kernels._quantize(x, 64)
        inputs = (xq.reshape(21, 2, 32) * xs[:, :, None].astype(np.float64)).reshape(21, 64)[:, :37]
        dense = layer.weight.astype(np.float64) * layer.scale[:, None]
    else:
        bands = banded(layer)
        assert bands.weight.shape == (3, 37, kernels.LANES)
        inputs, dense = x.astype(np.float64), layer.weight.astype(np.float64)
    assert kernels.out_features(bands) == n_out
    alone = np.concatenate([kernels.matvec(bands, x[r : r + 1]) for r in range(21)])
    for rows in range(1, 22):
        got = kernels.matvec(bands, x[:rows])
        want = inputs[:rows] @ dense.T + (0.0 if layer.bias is None else layer.bias)
        bound = 37 * np.finfo(np.float32).eps * (np.abs(inputs[:rows]) @ np.abs(dense).T + 1.0)
        assert np.all(np.abs(got - want) <= bound), rows
        np.testing.assert_array_equal(got, alone[:rows])


def test_int8_activations_are_each_block_of_32_rounded_to_its_own_steps() -> None:
    """`_quantize`, q8_0's rule: each block of 32 inputs in steps of its largest magnitude / 127, each value
    rounded to the nearest step (within half a step, in [-127, 127], the largest at +-127), a block of
    zeros all zeros with scale 0, the inputs past the row's end zeros; the correction -128 times each
    block's sum of steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 70), dtype=np.float32) * np.float32(10.0) ** rng.integers(-3, 3, (3, 70))
    x[1, 32:64] = 0.0
    xq, xs, xc = kernels._quantize(x, 96)
    assert xq.shape == (3, 96) and xs.shape == xc.shape == (3, 3)
    padded = np.zeros((3, 96), dtype=np.float32)
    padded[:, :70] = x
    blocks, steps = padded.reshape(3, 3, 32), xq.reshape(3, 3, 32).astype(np.int64)
    np.testing.assert_allclose(xs, np.abs(blocks).max(-1) / 127, rtol=1e-6)
    assert xs[1, 1] == 0 and (steps[1, 1] == 0).all() and (xq[:, 70:] == 0).all()
    assert (np.abs(steps) <= 127).all() and (np.abs(steps).max(-1)[xs > 0] == 127).all()
    assert (np.abs(blocks - steps * xs[..., None]) <= xs[..., None] * (0.5 + 1e-5)).all()
    np.testing.assert_array_equal(xc, -128 * steps.sum(-1))


def test_a_batch_rounded_on_every_thread_rounds_each_row_as_alone() -> None:
    """Past SPREAD_FROM values `_quantize` rounds a batch's rows on every thread: each row's steps,
    scales and corrections are the bits it gets alone (on the one-thread path)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, kernels.SPREAD_FROM // 8 + 40), dtype=np.float32)
    together = kernels._quantize(x, x.shape[1] + 24)
    for b in range(8):
        alone = kernels._quantize(x[b : b + 1], x.shape[1] + 24)
        for got, want in zip(together, alone, strict=True):
            np.testing.assert_array_equal(got[b : b + 1], want)


@numba.njit
def _int8_band(w: np.ndarray, n_in: int, x: tuple, out: np.ndarray, portable: bool) -> None:
    """Rows of quantized x through one int8 band, eight, four, two and one rows a pass, by the CPU's byte
    dot-product instruction or the portable sums."""
    if portable:
        kernels._band_sums(w, 0, n_in, x, 0, out, 0, 8, True, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 8, out, 0, 4, True, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 12, out, 0, 2, True, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 14, out, 0, 1, True, 0, 0)
    else:
        kernels._band_sums(w, 0, n_in, x, 0, out, 0, 8, False, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 8, out, 0, 4, False, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 12, out, 0, 2, False, 0, 0)
        kernels._band_sums(w, 0, n_in, x, 14, out, 0, 1, False, 0, 0)


def test_the_portable_int8_sums_are_the_dot_product_instructions_bit_for_bit() -> None:
    """The int8 bands' sums without the CPU's byte dot-product instruction (CPUs without VNNI) are the
    instruction's, bit for bit: exact integer sums of each block, scaled alike (where this CPU has no
    such instruction both are the portable ones)."""
    rng = np.random.default_rng(1)
    layer = int8_linear(LinearWeights(rng.standard_normal((16, 96), dtype=np.float32), None))
    w = np.ascontiguousarray(quantized_bands(layer).weight).reshape(-1)
    x = kernels._quantize(rng.standard_normal((15, 96), dtype=np.float32), 96)
    got = [np.empty((15, kernels.LANES), dtype=np.float32) for _ in range(2)]
    for portable, out in zip((False, True), got, strict=True):
        _int8_band(w, 96, x, out, portable)
    np.testing.assert_array_equal(got[0], got[1])
    # each block's integer sums (the weights' bytes less 128), scaled by the block's activation scale
    steps, weights = (
        x[0].reshape(15, 3, 32).astype(np.int64),
        layer.weight.astype(np.int64).reshape(16, 3, 32),
    )
    blocks = np.einsum("bki,jki->bkj", steps, weights)
    terms = blocks * x[1][:, :, None].astype(np.float64)
    bound = 3 * np.finfo(np.float32).eps * np.abs(terms).sum(1)  # three blocks' sums rounded and added
    assert (np.abs(got[0] - terms.sum(1)) <= bound).all()


def test_an_engine_holds_its_blocks_as_bands_where_every_width_is_a_multiple_of_16() -> None:
    """Widths of 32 (GPT-2's bias, a tied head): every block matrix as bands, the head the embedding
    table's rows, every prefill through the kernels; a step of three rows and one of one row compute the
    exact logits within float32's bound, and the same bits for the same row (the bands sum a row in one
    order at any batch; the head by rows, whose batches of four or more sum in another order than one
    row's, takes fewer here). Widths of 40: rows."""
    config = replace(CONFIGS["gpt2"], n_embd=32, n_head=4)
    engine, model = engine_of(config, tile_from=None)
    assert engine.bands and engine.kernel_rows > config.block_size
    assert all(lin.weight.ndim == 3 for b in engine.weights.h for lin in (b.attn.c_attn, b.mlp.c_proj))
    assert engine._head.weight is engine.weights.wte
    ids = torch.randint(0, config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(5))
    batch, one = engine.new_cache(3), engine.new_cache(1)
    engine.forward(ids[:, :3].tolist(), batch)
    engine.forward(ids[:1, :3].tolist(), one)
    for t in range(3, 6):
        got = engine.forward(ids[:, t : t + 1].tolist(), batch)
        assert_near_exact(got, float64_logits(model, ids[:, : t + 1]), config, f"step {t}")
        np.testing.assert_array_equal(got[0], engine.forward(ids[:1, t : t + 1].tolist(), one)[0])
    assert not engine_of(CONFIGS["gpt2"])[0].bands


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", ["gpt2", "modern", "value-embeds-skips-cap-dot"])
def test_a_prefill_through_the_kernels_computes_what_numpy_computes(name: str, quantize: str) -> None:
    """A prefill of 3 rows of 9 tokens (27 rows a product: tiles of four and a rest of three) with every
    product through the kernels and with none: the logits of every position within twice the float32
    bound of each other (float32: the last within the bound of the exact logits), the caches equal."""
    config = CONFIGS[name]
    engine, model = engine_of(config, quantize=quantize)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    logits, caches = [], []
    for rows in (10**9, 0):  # every product through the kernels, then none
        engine.kernel_rows = rows
        caches.append(engine.new_cache(3))
        logits.append(engine.forward(ids.tolist(), caches[-1], every_position=True))
    if quantize == "none":
        assert_near_exact(logits[0][:, -1], float64_logits(model, ids), config, f"{name}, kernels")
    assert np.abs(logits[0] - logits[1]).max() <= 2 * float32_bound(config, logits[1]), name
    for mine, theirs in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


def _elementwise(f: Any) -> Any:
    """A compiled loop of the compiled scalar function f over an array, f called directly (so compiled
    into the loop as the kernels' loops compile it, not through a function pointer)."""

    @numba.njit
    def each(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = f(x[i])
        return out

    return each


_exps = _elementwise(kernels._exp)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_two_tasks_at_a_time_is_attention_one_at_a_time(dtype: type) -> None:
    """`_attend` over 7 rows at their own positions (some past the ring's capacity) in 3 cache rows, 3
    query heads sharing one key/value head (7 x 3 = 21 tasks: an odd count, pairs of tasks with
    different key counts): taking tasks two at a time (few threads) and one at a time (many) gives the
    softmax attention computed in float64, within float32's rounding of the sums."""
    rng = np.random.default_rng(0)
    rows, n_head, n_kv, hd, cap = 7, 3, 1, 16, 10
    qkv = rng.standard_normal((rows, (n_head + 2 * n_kv) * hd), dtype=np.float32)
    kc = rng.standard_normal((3, n_kv, cap, hd)).astype(dtype)
    vc = rng.standard_normal((3, n_kv, cap, hd)).astype(dtype)
    positions = np.array([0, 3, 9, 14, 1, 2, 30], dtype=np.int64)
    cache_rows = np.array([0, 1, 2, 0, 1, 2, 2], dtype=np.int64)
    want = np.zeros((rows, n_head * hd))
    for b in range(rows):
        keys = min(positions[b] + 1, cap)
        k, v = kc[cache_rows[b], 0, :keys].astype(np.float64), vc[cache_rows[b], 0, :keys].astype(np.float64)
        for h in range(n_head):
            s = k @ qkv[b, h * hd : (h + 1) * hd].astype(np.float64) * 0.25
            p = np.exp(s - s.max())
            want[b, h * hd : (h + 1) * hd] = p @ v / p.sum()
    bits = (lambda a: a.view(np.uint16)) if dtype == np.float16 else (lambda a: a)
    for threads in (1, 2, 1000):  # 21 tasks: two at a time on 1 and 2 threads, one at a time on 1000
        got = np.zeros((rows, n_head * hd), dtype=np.float32)
        kernels._attend(qkv, bits(kc), bits(vc), n_head, n_kv, positions, cache_rows, 0.25, got, threads)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{threads} threads")


@pytest.mark.slow
def test_the_kernels_exp_is_float32_exact_to_a_few_units_in_the_last_place() -> None:
    """`_exp` (GELU, SwiGLU and the softmax): within 4 float32 ulps of exp in float64 wherever float32
    holds the result as a normal number (NumPy's own float32 exp: 2); 0 below -87.3; finite and at least
    1e38 where e^x passes float32's largest, so x / (1 + e^x) is within 1e-37 |x| of the 0 infinity gives."""
    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001), [-1e-30, 0.0, 1e-30]]).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(_exps(x) - exact) / ulp).max() <= 4
    assert (_exps(np.float32([-87.31, -100.0, -1e30, -np.inf])) == 0).all()
    big = _exps(np.float32([88.4, 89.0, 1e30, np.inf]))
    assert np.isfinite(big).all() and (big >= 1e38).all()
    assert (np.abs(np.float32(-5.0) / (np.float32(1.0) + big)) <= 5e-37).all()


_weights = _elementwise(kernels._exp_weight)


def test_the_draws_exp_is_float64_exact_to_a_few_units_in_the_last_place() -> None:
    """`_exp_weight` (the draw's weights, z <= 0): within 2 float64 ulps of NumPy's exp from -708 to 0,
    tiny and large magnitudes alike, exactly 1 at 0; 0 below -708 (where 2^k leaves the normal numbers)."""
    z = np.concatenate([np.linspace(-708.0, 0.0, 400_001), -np.geomspace(1e-300, 700.0, 10_001), [0.0, -0.0]])
    exact = np.exp(z)
    assert (np.abs(_weights(z) - exact) / np.spacing(exact)).max() <= 2
    assert _weights(np.array([0.0]))[0] == 1.0
    assert (_weights(np.array([-708.01, -745.0, -1e300, -np.inf])) == 0).all()


def test_the_compiled_draw_picks_what_a_cumulative_sum_and_a_search_pick() -> None:
    """`kernels.draw`: for each row, the first token whose running sum of exp(z - max z) passes u times
    the total, as a NumPy cumsum and searchsorted(side="right") give, for uniforms across [0, 1), every
    temperature, rows with -inf logits (never drawn) and a row broadcast to many (stride 0)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 4
    logits[2, ::2] = -np.inf  # half the vocabulary impossible
    logits[3, :-1] = -np.inf  # one possible token, the last
    for temperature in (1e-320, 1e-40, 0.3, 0.8, 1.0, 2.5):  # subnormals: argmax, never NaN
        for u in (np.zeros(6), np.full(6, 1 - 2**-53), *rng.random((40, 6))):
            with np.errstate(over="ignore"):
                z = (logits.astype(np.float64) - logits.max(-1, keepdims=True)) / temperature
            cdf = np.cumsum(np.exp(z), -1)
            want = [min(np.searchsorted(cdf[r], u[r] * cdf[r, -1], side="right"), 299) for r in range(6)]
            got = kernels.draw(logits, temperature, u)
            assert got.tolist() == want
            assert np.isfinite(logits[2, got[2]]) and got[3] == 299
            assert temperature > 1e-30 or got.tolist() == logits.argmax(-1).tolist()
    wide = rng.standard_normal((5, kernels.SPREAD_FROM // 4)).astype(np.float32) * 3  # drawn on every thread
    u = rng.random(5)
    cdf = np.cumsum(np.exp(wide.astype(np.float64) - wide.max(-1, keepdims=True)), -1)
    want = [np.searchsorted(cdf[r], u[r] * cdf[r, -1], side="right") for r in range(5)]
    assert kernels.draw(wide, 1.0, u).tolist() == want
    row = np.broadcast_to(logits[:1], (4, 300))
    u = rng.random(4)
    assert kernels.draw(row, 1.0, u).tolist() == [
        kernels.draw(logits[:1], 1.0, u[i : i + 1])[0] for i in range(4)
    ]


@pytest.mark.slow
def test_kernels_run_only_where_they_compute_the_model() -> None:
    for score in ("general", "additive"):  # the scores the kernels lack stay on the array path
        engine, _ = engine_of(replace(CONFIGS["modern"], attn_score=score))
        assert not engine.kernels
    engine, _ = engine_of(CONFIGS["modern"], layout="input-major")  # the kernels read (out, in) rows
    assert not engine.kernels and engine.layout == "input-major"
    engine, _ = engine_of(CONFIGS["modern"], layout="auto")  # auto: the kernels' layout, untimed
    assert engine.kernels and engine.layout == "output-major"


def test_without_numba_the_engine_runs_its_array_path(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "available", lambda: False)
    engine, model = engine_of(CONFIGS["gpt2"])
    assert not engine.kernels
    cache = engine.new_cache(1)
    engine.forward([[1, 2, 3]], cache)
    assert np.isfinite(engine.forward([[4]], cache)).all()
    with pytest.raises(UsageError, match="need numba: pip install numba"):
        engine_of(CONFIGS["gpt2"], kernels=True)


def test_the_thread_tuner_switches_the_kernels_threads_and_keeps_blas_on_one(monkeypatch) -> None:
    from threadpoolctl import threadpool_info

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    seen: list[int] = []
    now = [0]

    def set_kernels(n: int) -> None:
        seen.append(n)
        now[0] = n

    tuner = blas_tuner(None, (lambda: now[0], set_kernels))
    assert seen == [tuner.candidates[0]] and blas_threads() == {1}
    for n in tuner.candidates:
        tuner.use(n)
        assert now[0] == n and blas_threads() == {1}  # the prefills' BLAS stays on one thread
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # a count the environment fixes is the kernels'
    fixed = blas_tuner(None, (lambda: now[0], set_kernels))
    assert fixed.candidates == [2] and now[0] == 2 and blas_threads() == {1}
    kernels.set_threads(1)
    assert kernels.get_threads() == numba.get_num_threads() == 1
    kernels.set_threads(10_000)  # at most the threads numba started with
    assert kernels.get_threads() == numba.config.NUMBA_NUM_THREADS


def test_a_load_that_compiles_the_kernels_says_so(monkeypatch) -> None:
    said: list[str] = []
    engine_of(CONFIGS["gpt2"], notice=said.append)  # numba's cache holds them (conftest): nothing to say
    assert said == []
    monkeypatch.setattr(kernels, "missing", lambda wanted: list(wanted))
    engine_of(CONFIGS["gpt2"], notice=said.append)
    assert said == ["compiling the NumPy engine's decoding kernels for this CPU, once (numba keeps them)"]
    engine_of(CONFIGS["gpt2"], notice=said.append, kernels=False)  # the array path compiles nothing
    assert len(said) == 1


def test_load_engine_decodes_without_kernels_numbas_cache_lacks_and_says_so(
    tmp_path, monkeypatch, capsys
) -> None:
    run = save(tmp_path / "run", tiny_model(8))
    engine, _ = load_engine(run, "numpy")
    assert engine.kernels and capsys.readouterr().err == ""
    monkeypatch.setattr(kernels, "missing", lambda wanted: list(wanted))
    engine, _ = load_engine(run, "numpy")
    assert not engine.kernels and engine.path == "array path" and engine.layout == "output-major"
    assert capsys.readouterr().err == f"{BACKGROUND}\n"
