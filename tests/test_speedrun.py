"""The speedrun levers against references written here: value embeddings, U-net skips, logit soft-capping,
zero-initialised projections, and Muon's orthogonalisers (Newton-Schulz, Polar Express) and NorMuon."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from test_architecture import config
from test_decode import ENGINES, GREEDY, tiny_model

from minigpt.convert.hf_map import family_for
from minigpt.errors import MinigptError, UsageError
from minigpt.generate.decode import decode
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.model import gpt as tm
from minigpt.model import rotary
from minigpt.model.build import model_tensors
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.init import zero_output_projections
from minigpt.model.params import count_params
from minigpt.train.budget import batch_at, window_at
from minigpt.train.config import TrainConfig
from minigpt.train.muon import NS_QUINTIC, Muon, orthogonalize, polar_express
from minigpt.train.optimizers import make_optimizer, muon_dtype

SPEEDRUN = dict(value_embeds=True, skips=True, logit_cap=6.0)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def same_weights(source: GPT, config: GPTConfig) -> GPT:
    """A model of `config` holding `source`'s tensors wherever it has one of the same name (the rest as
    `config` initialises them)."""
    model = GPT(config).eval()
    theirs = dict(source.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in theirs:
                p.copy_(theirs[name])
    return model


# --- the architecture options --------------------------------------------------------------------------


def test_value_embeddings_add_each_tokens_row_to_its_values() -> None:
    torch.manual_seed(0)
    model = GPT(config(value_embeds=True, n_kv_head=2)).eval()
    w = model.weights().h[1].attn
    x, idx = torch.randn(3, 5, 32), torch.randint(0, 29, (3, 5))
    q, k, v = tm.qkv(w, x, None, idx)
    hd, kv = 8, 2
    plain = (x @ w.c_attn.weight.T + w.c_attn.bias)[..., (4 + kv) * hd :]
    want = (plain + w.v_embed[idx]).view(3, 5, kv, hd).transpose(1, 2)
    torch.testing.assert_close(v, want)
    assert w.v_embed.shape == (29, kv * hd)
    # with its tables at zero the model is the one without them
    without = same_weights(model, config(n_kv_head=2))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.v_embed.weight.zero_()
        torch.testing.assert_close(model(idx, all_logits=True)[0], without(idx, all_logits=True)[0])


@pytest.mark.parametrize("n_layer", [2, 3, 5])
def test_skips_carry_the_first_layers_inputs_to_their_mirrors(n_layer: int) -> None:
    """The forward pass against a loop written here: layer L-1-i adds, times its weight, the input
    layer i had (layer 0's is the embeddings)."""
    torch.manual_seed(1)
    cfg = config(n_layer=n_layer, skips=True, pos="rope")
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.5, -1.5][: n_layer // 2]))
    w = model.weights()
    idx = torch.randint(0, 29, (2, 9))
    rope = rotary.rotary(cfg.rope_base, cfg.head_dim, 0, 9, idx.device)
    x, inputs = w.wte[idx], {}
    for layer, block in enumerate(w.h):
        mirror = n_layer - 1 - layer
        if mirror < layer:
            x = x + model.skip_weights[mirror] * inputs[mirror]
        inputs[layer] = x
        x = tm.block(block, x, layer, rope=rope)
    want = tm.norm(w.ln_f, x) @ w.lm_head.T
    with torch.no_grad():
        torch.testing.assert_close(model(idx, all_logits=True)[0], want)
    assert cfg.skip_pairs == tuple((i, n_layer - 1 - i) for i in range(n_layer // 2))
    with pytest.raises(UsageError, match="need n_layer 2 or more"):
        config(n_layer=1, skips=True)


def test_logit_cap_is_cap_times_tanh_of_the_logits_over_cap() -> None:
    torch.manual_seed(2)
    capped = tiny_model(2, config(logit_cap=3.0), scale=20.0)
    plain = same_weights(capped, config())
    idx = torch.randint(0, 29, (2, 7))
    with torch.no_grad():
        raw = plain(idx, all_logits=True)[0]
        got = capped(idx, all_logits=True)[0]
        loss = capped(idx, idx)[1]  # head_loss: the cap applied chunk by chunk
    assert raw.abs().max() > 3.0  # the cap bites
    torch.testing.assert_close(got, 3.0 * torch.tanh(raw / 3.0))
    assert got.abs().max() < 3.0
    want = torch.nn.functional.cross_entropy(got.view(-1, 29), idx.view(-1))
    torch.testing.assert_close(loss, want)
    for bad in (0.0, -1.0, math.inf, True):
        with pytest.raises(UsageError, match="logit_cap must be a positive number"):
            config(logit_cap=bad)


@pytest.mark.slow
@pytest.mark.parametrize("options", [SPEEDRUN, dict(SPEEDRUN, n_layer=4, n_kv_head=1, window=5, pos="rope")])
def test_numpy_engine_equals_the_torch_model_with_the_speedrun_options(options: dict[str, Any]) -> None:
    """Logits through the cache (prefill, two tokens, then one at a time) against GPT.forward over the
    whole sequence, and the same greedy tokens past the block on both engines."""
    cfg = config(**options)
    model = tiny_model(3, cfg, scale=3.0)
    idx = torch.randint(0, 29, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(idx, all_logits=True)[0].numpy()
    tensors = {k: v.numpy() for k, v in model_tensors(model).items()}
    chunks = [idx[:, :7], idx[:, 7:9], *[idx[:, t : t + 1] for t in range(9, 16)]]
    for layout in ("output-major", "input-major"):  # the engines' decoding layouts (main's issue 30)
        for engine in (NumpyEngine(cfg, tensors, layout=layout), TorchEngine(model, layout=layout)):
            name = f"{engine.name} {layout}"
            cache = engine.new_cache(2)
            got = np.stack([np.asarray(engine.forward(c.tolist(), cache)) for c in chunks], axis=1)
            np.testing.assert_allclose(
                got, want[:, [6, 8, *range(9, 16)]], rtol=1e-4, atol=1e-4, err_msg=name
            )
            every = np.asarray(engine.forward(idx.tolist(), None, every_position=True))
            np.testing.assert_allclose(every, want, rtol=1e-4, atol=1e-4, err_msg=name)
    prompts = idx[:, :4].tolist()
    tokens = [list(decode(make(model), prompts, 40, sampling=GREEDY)) for make in ENGINES.values()]
    assert all(t == tokens[0] for t in tokens)


def test_params_counts_the_new_tensors_and_convert_refuses_them() -> None:
    for options in ({"value_embeds": True}, {"skips": True, "n_layer": 5}, {"logit_cap": 30.0}):
        cfg = config(n_kv_head=2, **options)
        report = count_params(cfg)
        assert report.exact_total == GPT(cfg).num_params(), options
        adjustments = {r.name: r.count for r in report.adjustments}
        assert adjustments.get("Value embeddings", 0) == (29 * 2 * 8 * 2 if cfg.value_embeds else 0)
        assert adjustments.get("U-net skip weights", 0) == (2 if cfg.skips else 0)
        # value embeddings are lookups: no FLOPs, as position embeddings
        plain = count_params(replace(cfg, value_embeds=False, skips=False, logit_cap=None))
        assert report.flops_per_token["forward"] == plain.flops_per_token["forward"] + 2 * (
            2 if cfg.skips else 0
        )
        flag = next(iter(options)).replace("_", "-")
        with pytest.raises(MinigptError, match=f"this model has --{flag}"):
            family_for(replace(cfg, pos="rope", norm="rmsnorm", mlp="swiglu"))
    assert "value embeds, skips, logit cap 6" in config(**SPEEDRUN).architecture


def test_zero_init_zeroes_the_output_projections_and_draws_the_rest_alike() -> None:
    torch.manual_seed(4)
    plain = GPT(config(tie_embeddings=False))
    torch.manual_seed(4)
    zeroed = GPT(config(tie_embeddings=False))
    zero_output_projections(zeroed)
    for (name, a), (_, b) in zip(plain.named_parameters(), zeroed.named_parameters(), strict=True):
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            assert not b.any(), name
        else:
            assert torch.equal(a, b), name
    idx = torch.randint(0, 29, (2, 8))
    _, loss = zeroed(idx, idx)
    assert loss.item() == pytest.approx(math.log(29))  # every logit 0: the uniform distribution
    tied = GPT(config())
    head = tied.lm_head.weight.clone()
    zero_output_projections(tied)
    assert torch.equal(tied.lm_head.weight, head)  # a tied head is the token embedding: kept


# --- Muon -----------------------------------------------------------------------------------------------


def reference_orthogonalize(
    g: torch.Tensor, quintics: tuple[tuple[float, float, float], ...]
) -> torch.Tensor:
    """One matrix at a time in float64: over its Frobenius norm, then X <- aX + b(XXᵀ)X + c(XXᵀ)²X on the
    wide orientation."""
    x = g.double()
    wide = x.T if x.size(0) > x.size(1) else x
    wide = wide / wide.norm().clamp(min=1e-7)
    for a, b, c in quintics:
        gram = wide @ wide.T
        wide = a * wide + b * gram @ wide + c * gram @ gram @ wide
    return wide.T if x.size(0) > x.size(1) else wide


@pytest.mark.parametrize("shape", [(3, 12, 20), (2, 20, 12), (1, 16, 16)])
def test_orthogonalize_is_the_quintic_iteration_on_every_matrix(shape: tuple[int, int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    for quintics in ((NS_QUINTIC,) * 5, polar_express()):
        got = orthogonalize(g, quintics)
        want = torch.stack([reference_orthogonalize(m, quintics) for m in g])
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_polar_express_quintics_are_minimax_and_beat_newton_schulz() -> None:
    """Chebyshev's alternation theorem: an odd quintic (3 coefficients) is the best approximation of 1 on
    an interval exactly when its error reaches its maximum at 4 points with alternating signs; so each
    quintic (its safety factor undone) alternates on the interval the ones before left."""
    low, high = 1e-3, 1.0
    for a, b, c in polar_express():
        a, b, c = a * 1.01, b * 1.01**3, c * 1.01**5  # the quintic before x -> x / 1.01
        x = np.linspace(low, high, 400_001)
        error = 1.0 - (a * x + b * x**3 + c * x**5)
        peak = np.abs(error).max()
        extremes = [
            i
            for i in range(1, len(x) - 1)
            if abs(error[i]) >= abs(error[i - 1]) and abs(error[i]) >= abs(error[i + 1])
        ]
        points = [0, *extremes, len(x) - 1]
        assert len(points) == 4
        assert np.allclose(np.abs(error[points]), peak, rtol=1e-6)
        assert np.all(np.sign(error[points]) == [1, -1, 1, -1])
        q = (a / 1.01, b / 1.01**3, c / 1.01**5)
        values = q[0] * x + q[1] * x**3 + q[2] * x**5
        low, high = values.min(), values.max()
    # the singular values of a badly conditioned matrix end up near 1, far nearer than Newton-Schulz's
    sigma = np.geomspace(1e-3, 1.0, 10_000)
    ranges = {}
    for name, quintics in (("polar", polar_express()), ("ns", (NS_QUINTIC,) * 5)):
        y = sigma.copy()
        for a, b, c in quintics:
            y = a * y + b * y**3 + c * y**5
        ranges[name] = (y.min(), y.max())
    assert 0.85 < ranges["polar"][0] and ranges["polar"][1] < 1.15
    assert ranges["ns"][0] < 0.5


def reference_step(
    weight: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor,
    rows: torch.Tensor | None,
    lr: float,
    decay: float,
) -> torch.Tensor:
    """One Muon step written out: Nesterov momentum 0.95, Newton-Schulz, NorMuon's rows when `rows` is
    given (updated in place), the rate scaled by sqrt(max(1, rows/columns)), decoupled weight decay."""
    buf.mul_(0.95).add_(grad, alpha=0.05)
    update = reference_orthogonalize(grad * 0.05 + buf * 0.95, (NS_QUINTIC,) * 5).float()
    if rows is not None:
        rows.mul_(0.95).add_(update.square().mean(dim=1), alpha=0.05)
        normalised = update / (rows.sqrt()[:, None] + 1e-8)
        update = normalised * math.sqrt(min(update.shape)) / normalised.norm()
    scale = lr * math.sqrt(max(1.0, weight.size(0) / weight.size(1)))
    return weight * (1 - lr * decay) - scale * update


@pytest.mark.parametrize("normuon", [False, True])
def test_muon_steps_as_written_out(normuon: bool) -> None:
    torch.manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in ((24, 8), (24, 8), (8, 8))]
    optimizer = Muon(params, lr=0.02, weight_decay=0.1, normuon=normuon)
    want = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    rows = [torch.zeros(p.size(0)) for p in params]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            want[i] = reference_step(want[i], g, bufs[i], rows[i] if normuon else None, 0.02, 0.1)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=1e-4, atol=1e-5)
    expected = {"momentum_buffer": (24, 8), **({"row_mean_square": (24,)} if normuon else {})}
    assert optimizer.slots(params[0]) == expected
    assert set(optimizer.state[params[0]]) == set(expected)


def test_muon_in_bf16_is_torchs_muon_step_for_step() -> None:
    """`--muon-dtype bfloat16` with Newton-Schulz is torch.optim.Muon's arithmetic, bit for bit (the
    default on the CPU, float32, is the written-out step above)."""
    torch.manual_seed(7)
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in ((24, 8), (24, 8), (8, 8), (8, 24))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = Muon(ours, lr=0.02, weight_decay=0.1, dtype="bfloat16")
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_muon_trains_the_blocks_matrices_but_not_the_value_embeddings() -> None:
    model = GPT(config(value_embeds=True, skips=True))
    cfg = TrainConfig(
        lr=1e-2, optimizer="muon", muon_lr=0.02, orthogonalizer="polar-express", normuon=True
    ).with_recipe("cpu")
    optimizer = make_optimizer(model, cfg)
    adamw, muon = optimizer.parts
    assert isinstance(muon, Muon) and muon.normuon and muon.polynomials == polar_express()
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = name.startswith("transformer.h.") and p.dim() == 2 and "v_embed" not in name
        assert (id(p) in in_muon) == hidden, name
    with pytest.raises(UsageError, match="unknown orthogonalizer 'svd'"):
        TrainConfig(orthogonalizer="svd")


def test_muon_iterates_in_bf16_where_the_run_computes_in_bf16() -> None:
    """--muon-dtype auto follows the run's compute dtype: bf16 autocast (a CPU with bf16 instructions, or a
    GPU) orthogonalises in bf16, a float32 run in float32; a dtype given by name is kept."""
    assert muon_dtype("auto", torch.bfloat16) == "bfloat16"
    assert muon_dtype("auto", torch.float32) == "auto" and muon_dtype("auto", None) == "auto"
    assert muon_dtype("float32", torch.bfloat16) == "float32"
    cfg = TrainConfig(lr=1e-2, optimizer="muon", muon_lr=0.02).with_recipe("cpu")
    for compute, work in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        _, muon = make_optimizer(GPT(config()), cfg, compute).parts
        assert isinstance(muon, Muon) and muon._work_dtype(torch.device("cpu")) == work


# --- schedules ------------------------------------------------------------------------------------------


def test_the_batch_ramps_from_a_quarter_to_the_whole_batch() -> None:
    cfg = TrainConfig(batch_size=16, batch_ramp=0.5)
    assert [batch_at(cfg, p) for p in (0.0, 0.125, 0.25, 0.49, 0.5, 0.9)] == [4, 7, 10, 15, 16, 16]
    assert batch_at(TrainConfig(batch_size=16), 0.0) == 16
    assert batch_at(TrainConfig(batch_size=2, batch_ramp=1.0), 0.0) == 1
    for bad in (-0.1, 1.5):
        with pytest.raises(UsageError, match="batch_ramp is a fraction"):
            TrainConfig(batch_ramp=bad)


def test_the_windows_ramp_from_a_quarter_to_the_whole_block() -> None:
    cfg = TrainConfig(seq_ramp=0.5)
    assert [window_at(cfg, 128, p) for p in (0.0, 0.125, 0.25, 0.49, 0.5, 0.9)] == [32, 56, 80, 120, 128, 128]
    assert len({window_at(cfg, 1024, p / 1000) for p in range(1001)}) == 13  # 256, 320, ..., 1024
    assert window_at(TrainConfig(), 128, 0.0) == 128
    assert window_at(TrainConfig(seq_ramp=1.0), 2, 0.0) == 1
    for bad in (-0.1, 1.5):
        with pytest.raises(UsageError, match="seq_ramp is a fraction"):
            TrainConfig(seq_ramp=bad)


@pytest.mark.parametrize(
    "ramp, batches, windows",
    [
        (dict(batch_ramp=0.5), [2, 3, 5, 6, 8, 8, 8, 8], [32] * 8),  # tiny's block_size: 32
        (dict(seq_ramp=0.5), [8] * 8, [8, 14, 20, 26, 32, 32, 32, 32]),
    ],
    ids=["batch", "windows"],
)
def test_a_ramped_run_draws_and_counts_what_the_ramp_says(
    tmp_path, monkeypatch, ramp: dict[str, float], batches: list[int], windows: list[int]
) -> None:
    from minigpt.data.dataset import BatchSampler, DataConfig
    from minigpt.train.loop import train

    drawn: list[tuple[int, ...]] = []
    real = BatchSampler.next_batch

    def spy(self: BatchSampler) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = real(self)
        drawn.append(tuple(x.shape))
        return x, y

    monkeypatch.setattr(BatchSampler, "next_batch", spy)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = TrainConfig(
        preset="tiny", batch_size=8, max_iters=8, eval_iters=1, eval_every=8, log_every=1, warmup=0,
        device="cpu", dtype="float32", **ramp,
    )  # fmt: skip
    result = train(
        cfg, DataConfig(paths=(text,), tokenizer="char", cache_dir=tmp_path / "cache"), out=tmp_path / "r"
    )
    assert [batch_at(cfg, step / 8) for step in range(8)] == batches
    assert [window_at(cfg, 32, step / 8) for step in range(8)] == windows
    assert drawn == list(zip(batches, windows, strict=True))
    sizes = [b * w for b, w in zip(batches, windows, strict=True)]
    assert result.state.tokens == sum(sizes)
    steps = [r for r in result.metrics if r["kind"] == "train"]
    assert [r["tokens"] for r in steps] == [sum(sizes[: i + 1]) for i in range(8)]
