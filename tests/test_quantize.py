"""int8 weight-only decoding against float32: the weights, logits, greedy tokens, options and eval."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from numerics import assert_near_exact
from test_decode import GREEDY, TINY, tiny_model
from test_generate_cli import make_run, one_line_error

from minigpt.cli.main import app
from minigpt.errors import UsageError
from minigpt.generate.decode import decode
from minigpt.generate.engines import kernels
from minigpt.generate.engines.numpy_engine import NumpyEngine, int8_linear
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.generate.load import choose_backend, load_engine
from minigpt.model.build import model_tensors
from minigpt.model.quantize import check_quantize, quantize_int8, quantize_weights
from minigpt.model.weights import LinearWeights


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def test_int8_rows_keep_their_largest_weight_and_round_the_rest() -> None:
    weight = torch.randn(48, 32) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    q = quantize_int8(LinearWeights(weight, None))
    assert q.weight.dtype == torch.int8 and q.scale is not None and q.scale.shape == (48,)
    assert q.weight.abs().amax(dim=1).min() >= 126  # every row uses the whole range
    restored = q.weight.float() * q.scale.float()[:, None]
    # rounding to the nearest step: at most half a step off, relative to each row's own scale
    assert ((restored - weight).abs() <= q.scale.float()[:, None] * 0.5 + 1e-6).all()


def test_every_linear_layer_is_quantized_and_nothing_else() -> None:
    model = tiny_model()
    weights = model.weights()
    q = quantize_weights(weights, "int8")
    assert quantize_weights(weights, "none") is weights
    for block, qblock in zip(weights.h, q.h, strict=True):
        for linear, qlinear in [
            (block.attn.c_attn, qblock.attn.c_attn),
            (block.attn.c_proj, qblock.attn.c_proj),
            (block.mlp.c_fc, qblock.mlp.c_fc),
            (block.mlp.c_proj, qblock.mlp.c_proj),
        ]:
            assert qlinear.weight.dtype == torch.int8 and qlinear.bias is linear.bias
        assert qblock.ln_1.weight is block.ln_1.weight and qblock.ln_2.bias is block.ln_2.bias
    assert q.wte is weights.wte and q.lm_head is weights.lm_head and q.wpe is weights.wpe
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.float32  # the model is untouched


def test_int8_logits_stay_close_to_float32_and_greedy_text_agrees_where_margins_allow() -> None:
    model = tiny_model(4, scale=10.0)  # greedy text of 9 different tokens, most of them by a clear margin
    exact, quantized = TorchEngine(model), TorchEngine(model, "int8")
    assert quantized.quantize == "int8" and quantized.dtype == "float32"
    prompts = [[1, 2, 3], [4, 5, 6]]
    want_tokens = list(decode(exact, prompts, TINY.block_size - 3, sampling=GREEDY))
    got_tokens = list(decode(quantized, prompts, TINY.block_size - 3, sampling=GREEDY))
    # every position of the float32 greedy text, through both weight trees
    ids = torch.tensor([p + [step[r] for step in want_tokens] for r, p in enumerate(prompts)])
    with torch.no_grad():
        want = model(ids, all_logits=True)[0]
        got = model(ids, all_logits=True, weights=quantized.weights)[0]
    # int8 steps of 1/254 of a row's largest weight, bf16 inputs (8 bits of mantissa) to each layer
    tolerance = 0.02 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    # wherever float32's best token leads by more than twice that, int8 picks it too: the greedy text is
    # the same up to the first position where the margin is too thin to say
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > 2 * tolerance)[:, 2:-1]  # the positions that chose a new token
    assert clear.float().mean() > 0.75
    for row in range(len(prompts)):
        agree = int(clear[row].int().cumprod(0).sum())  # leading run of clear margins
        assert [s[row] for s in got_tokens[:agree]] == [s[row] for s in want_tokens[:agree]]
    assert (got.argmax(-1) == want.argmax(-1))[:, 2:-1][clear].all()


def test_options_are_checked_with_one_line_errors(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(UsageError, match="unknown quantization 'int4'"):
        check_quantize("int4", "cpu")
    with pytest.raises(UsageError, match="runs on the CPU"):
        check_quantize("int8", "meta")
    # int8 decodes on the NumPy engine's kernels where they run, else on torch's
    assert choose_backend("auto", "cpu", "auto", quantize="int8") == "numpy"
    with monkeypatch.context() as m:
        m.setattr(kernels, "available", lambda: False)
        assert choose_backend("auto", "cpu", "auto", quantize="int8") == "torch"
        with pytest.raises(UsageError, match="drop --quantize int8"):
            choose_backend("numpy", "cpu", "auto", quantize="int8")
    run = make_run(tmp_path / "run")
    for backend in ("numpy", "torch"):
        engine, _ = load_engine(run, backend, "cpu", "auto", "int8")
        assert engine.quantize == "int8" and engine.name == backend
    with pytest.raises(UsageError, match="unknown quantization 'int4'"):
        load_engine(run, "numpy", quantize="int4")


@pytest.mark.slow
def test_generate_and_eval_take_the_option(runner, tmp_path: Path) -> None:
    run = str(make_run(tmp_path / "run"))
    result = runner.invoke(app, ["generate", "a", "-m", run, "-n", "5", "--quantize", "int8", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["backend"] == "numpy" and data["quantize"] == "int8" and data["dtype"] == "float32"
    result = runner.invoke(
        app, ["generate", "a", "-m", run, "-n", "5", "--quantize", "int8", "--backend", "torch", "--json"]
    )
    assert result.exit_code == 0 and json.loads(result.stdout)["backend"] == "torch", result.stderr
    one_line_error(
        runner.invoke(app, ["generate", "a", "-m", run, "--quantize", "int8", "--explain"]), 2, "--explain"
    )
    one_line_error(runner.invoke(app, ["generate", "a", "-m", run, "--quantize", "int4"]), 2, "--quantize")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 20)
    losses = []
    for quantize in ("none", "int8"):
        result = runner.invoke(
            app, ["eval", run, str(text), "--device", "cpu", "--quantize", quantize, "--json"]
        )
        assert result.exit_code == 0, result.stderr
        losses.append(json.loads(result.stdout)["loss"])
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 0.01


def test_the_numpy_engine_holds_the_same_int8_weights_as_torchs() -> None:
    weight = torch.randn(48, 32) * torch.logspace(-3, 1, 48)[:, None]
    weight[5] = 0.0  # an all-zero row: the smallest scale, zeros
    want = quantize_int8(LinearWeights(weight, None))
    got = int8_linear(LinearWeights(weight.numpy(), None))
    assert got.weight.dtype == np.int8 and got.scale is not None and got.scale.dtype == np.float32
    np.testing.assert_array_equal(got.weight, want.weight.numpy())
    np.testing.assert_array_equal(got.scale, want.scale.float().numpy())


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "array-path"])
def test_numpy_int8_decodes_the_dequantized_model(kernels_on: bool) -> None:
    """The NumPy engine's int8 logits (a prefill, then one token at a time) against the model whose
    linear weights are the int8 rows times their scales, computed in float64. The array path rounds only
    the blocks' weights (its activations stay float32): within float32's bound. The kernels hold the
    head as int8 too and round each product's activations to int8 in blocks of 32, as llama.cpp's q8_0
    does (`kernels._quantize`: steps of 1/254 of a block's largest value): within the tolerance torch's
    int8 is held to (its activations bf16), and the same greedy choice wherever float64's best token
    leads by more than twice that."""
    model = tiny_model(4, scale=10.0)
    tensors = {k: v.detach().numpy() for k, v in model_tensors(model).items()}
    engine = NumpyEngine(model.config, tensors, quantize="int8", kernels=kernels_on)
    assert engine.kernels == kernels_on and engine.quantize == "int8"

    def dequantized(p: torch.Tensor) -> torch.Tensor:
        q = int8_linear(LinearWeights(p.detach().numpy(), None))
        return torch.from_numpy(q.weight.astype(np.float64) * q.scale[:, None])

    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        for name, p in exact_model.named_parameters():
            if p.dim() == 2 and name.startswith("transformer.h."):
                p.copy_(dequantized(p))
    tree = exact_model.weights()
    if kernels_on:  # the tied head as int8, the embeddings it shares a table with left float32
        tree = dataclasses.replace(tree, lm_head=dequantized(model.transformer.wte.weight))
    ids = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = exact_model(ids, all_logits=True, weights=tree)[0].numpy()[:, 4:]
    cache = engine.new_cache(2)
    got = [np.asarray(engine.forward(ids[:, :5].tolist(), cache))]
    got += [np.asarray(engine.forward(ids[:, t : t + 1].tolist(), cache)) for t in range(5, TINY.block_size)]
    if not kernels_on:
        assert_near_exact(np.stack(got, axis=1), exact, TINY, "NumPy int8")
        return
    tolerance = 0.02 * np.abs(exact).max()
    np.testing.assert_allclose(np.stack(got, axis=1), exact, rtol=0, atol=tolerance)
    top2 = np.sort(exact, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * tolerance
    assert clear.mean() > 0.5 and (np.stack(got, axis=1).argmax(-1) == exact.argmax(-1))[clear].all()
