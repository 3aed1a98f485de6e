"""The NumPy engine against the torch model: logits, cached greedy tokens, sampling rules, loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_sampling import TINY, nanogpt_loop, tiny_model

from minigpt import generation
from minigpt.config import GPTConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.generation import Generation, choose_backend
from minigpt.model import GPT
from minigpt.numpy_engine import NumpyEngine, NumpyGPT, NumpyKVCache, sample_next
from minigpt.rundir import RunDir
from minigpt.sampling import TorchEngine
from minigpt.tokenizer import CharTokenizer
from minigpt.weights import model_tensors

ROOT = Path(__file__).resolve().parent.parent


def numpy_twin(model: GPT) -> NumpyGPT:
    return NumpyGPT(model.config, {k: v.detach().float().numpy() for k, v in model_tensors(model).items()})


def greedy(engine: Any, prompt: list[int], n: int, **kw: Any) -> list[list[int]]:
    return list(engine.decode(prompt, n, temperature=0.0, **kw))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_forward_through_the_cache_matches_gpt_forward(bias: bool, tied: bool) -> None:
    config = GPTConfig(
        vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=bias, tie_embeddings=tied
    )
    model = tiny_model(1, config, scale=20.0)
    torch.manual_seed(2)
    ids = torch.randint(0, 37, (3, 12))
    with torch.no_grad():
        want = model(ids, all_logits=True)[0].numpy()
    twin, cache = numpy_twin(model), NumpyKVCache(config, 3)
    got = [twin.forward(ids[:, :7].numpy(), cache)]  # a prefill, then one token at a time
    got += [twin.forward(ids[:, t : t + 1].numpy(), cache) for t in range(7, 12)]
    for t, logits in zip(range(6, 12), got, strict=True):
        np.testing.assert_allclose(logits, want[:, t], rtol=1e-4, atol=1e-4)
    assert cache.pos == 12


def test_a_one_row_prefill_serves_every_row() -> None:
    model = tiny_model(3)
    twin, cache = numpy_twin(model), NumpyKVCache(TINY, 3)
    prompt = np.array([[4, 8, 15, 16]])
    twin.forward(prompt, cache)
    nxt = np.array([[1], [2], [3]])
    got = twin.forward(nxt, cache)
    with torch.no_grad():
        want = model(torch.from_numpy(np.hstack([prompt.repeat(3, 0), nxt])))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(UsageError, match="rows"):
        twin.forward(np.array([[1], [2]]), cache)


@pytest.mark.parametrize("slide", [1, None, 5, 16])
@pytest.mark.parametrize("prompt_len", [3, 16, 21])
def test_greedy_tokens_equal_the_torch_engine_inside_and_past_the_block(
    slide: int | None, prompt_len: int
) -> None:
    model = tiny_model(1)
    prompt = torch.randint(
        0, TINY.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    n = 3 * TINY.block_size + 5
    want = greedy(TorchEngine(model), prompt, n, num_samples=2, slide=slide)
    got = greedy(NumpyEngine(numpy_twin(model)), prompt, n, num_samples=2, slide=slide)
    assert got == want and len(got) == n
    assert len({row[0] for row in got[-TINY.block_size :]}) > 3  # a non-trivial sequence


def test_slide_one_is_nanogpts_crop_loop() -> None:
    model = tiny_model(4)
    prompt = [1, 2, 3, 4, 5]
    n = 2 * TINY.block_size
    want = nanogpt_loop(model, torch.tensor([prompt]), n)[0, 5:].tolist()
    got = greedy(NumpyEngine(numpy_twin(model)), prompt, n, slide=1)
    assert [row[0] for row in got] == want


# --- sampling -------------------------------------------------------------------------------------------


def draws(probs: list[float], n: int = 4000, seed: int = 0, **kw: Any) -> set[int]:
    logits = np.log(np.tile(np.array(probs, dtype=np.float32), (n, 1)))
    return set(
        sample_next(logits, kw.pop("temperature", 1.0), rng=np.random.default_rng(seed), **kw).tolist()
    )


def test_top_k_and_top_p_keep_the_same_tokens_as_the_torch_engine() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]  # ranked: 1, 3, 2, 0 (the cases of test_sampling)
    cases = [
        (None, None, {0, 1, 2, 3}),
        (2, None, {1, 3}),
        (3, None, {1, 2, 3}),
        (None, 0.5, {1}),
        (None, 0.7, {1, 3}),
        (None, 0.81, {1, 2, 3}),
        (None, 1.0, {0, 1, 2, 3}),
        (2, 0.99, {1, 3}),
        (3, 0.6, {1, 3}),
    ]
    for top_k, top_p, kept in cases:
        assert draws(probs, top_k=top_k, top_p=top_p) == kept, (top_k, top_p)


def test_top_k_keeps_exactly_k_tokens_among_ties() -> None:
    assert len(draws([0.25, 0.25, 0.25, 0.25], top_k=2, top_p=None)) == 2


def test_sample_frequencies_follow_the_renormalised_distribution() -> None:
    logits = np.log(np.tile(np.array([0.05, 0.5, 0.15, 0.3], dtype=np.float32), (20000, 1)))
    got = sample_next(logits, 1.0, 2, None, np.random.default_rng(1))
    assert abs((got == 1).mean() - 0.5 / 0.8) < 0.02


def test_temperature_zero_is_argmax_and_leaves_the_generator_alone() -> None:
    logits = np.random.default_rng(0).standard_normal((50, 10)).astype(np.float32)
    rng = np.random.default_rng(3)
    before = rng.bit_generator.state
    assert np.array_equal(sample_next(logits, 0.0, None, None, rng), logits.argmax(-1))
    assert rng.bit_generator.state == before


def test_seeds_reproduce_and_top_k_one_is_greedy() -> None:
    engine = NumpyEngine(numpy_twin(tiny_model(6)))
    kw = dict(num_samples=3, temperature=1.0, top_p=0.95)
    assert list(engine.decode([1, 2], 40, seed=5, **kw)) == list(engine.decode([1, 2], 40, seed=5, **kw))
    assert list(engine.decode([1, 2], 40, seed=5, **kw)) != list(engine.decode([1, 2], 40, seed=6, **kw))
    top1 = list(engine.decode([1, 2], 40, temperature=1.0, top_k=1, seed=9))
    assert top1 == greedy(engine, [1, 2], 40)


def test_generation_drives_either_engine_to_the_same_greedy_text() -> None:
    tok = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,;:!?'\n") + ["-"])
    model = tiny_model(7, GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32))
    texts = []
    for engine in (model, NumpyEngine(numpy_twin(model))):
        gen = Generation(engine, tok, tok.encode("hello"), max_new_tokens=50, temperature=0.0, num_samples=2)
        texts.append(
            [s.text for s in generation.generate(engine, tok, "hello", max_new_tokens=50, temperature=0)]
        )
        assert [e.sample for e in gen.events()] and len(gen.samples) == 2
    assert texts[0] == texts[1] and len(texts[0][0]) == 50


# --- loading and the choice of engine -------------------------------------------------------------------


def save(path: Path, model: GPT) -> Path:
    RunDir(path).save(model, CharTokenizer([chr(97 + i) for i in range(26)] + list(" .,;:!?'\n-A")), extra={})
    return path


def test_load_reads_a_run_and_names_what_is_wrong(tmp_path: Path) -> None:
    model = tiny_model(8)
    run = save(tmp_path / "run", model)
    engine, tok, data = NumpyEngine.load(run)
    assert tok.vocab_size == 37 and data["model"]["n_embd"] == 32
    assert greedy(engine, [1, 2, 3], 20) == greedy(TorchEngine(model), [1, 2, 3], 20)

    config = json.loads((run / "config.json").read_text())
    config["model"]["n_embd"] = 64
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(MinigptError, match="does not match its config.json"):
        NumpyEngine.load(run)

    run = save(tmp_path / "truncated", model)
    data_bytes = (run / RunDir.WEIGHTS).read_bytes()
    (run / RunDir.WEIGHTS).write_bytes(data_bytes[: len(data_bytes) // 2])
    with pytest.raises(MinigptError, match="corrupt"):
        NumpyEngine.load(run)

    run = save(tmp_path / "bf16", model.to(torch.bfloat16))
    with pytest.raises(MinigptError, match="NumPy cannot read.*--backend torch"):
        NumpyEngine.load(run)
    assert choose_backend("auto", "auto", "auto", weights=run / RunDir.WEIGHTS) == "torch"


def test_choose_backend(monkeypatch) -> None:
    monkeypatch.setattr(generation, "accelerator_visible", lambda: False)
    assert choose_backend("auto", "auto", "auto") == "numpy"
    assert choose_backend("auto", "cpu", "float32") == "numpy"
    assert choose_backend("auto", "cpu", "bfloat16") == "torch"
    assert choose_backend("auto", "auto", "auto", explain=True) == "torch"
    assert choose_backend("torch", "cpu", "float32") == "torch"
    monkeypatch.setattr(generation, "accelerator_visible", lambda: True)
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
        assert generation.accelerator_visible() is False


def test_cpu_generation_never_imports_torch(tmp_path: Path) -> None:
    run = save(tmp_path / "run", tiny_model(9))
    code = (
        "import sys\n"
        "from minigpt.cli import main\n"
        f"sys.argv = ['minigpt', 'generate', 'abc', '-m', {str(run)!r}, '-n', '30', '--seed', '1', '--device', 'cpu']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) == 30 and "numpy on cpu" in proc.stderr
    assert proc.stderr.strip().endswith("no torch")
