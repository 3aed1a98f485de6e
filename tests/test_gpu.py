"""The GPU path, skipped where torch sees no CUDA GPU (CI has none; the README's GPU section says where they
ran): bf16 training steps with and without --compile for both architectures and both optimizers, exact
resume on the GPU, the torch engine's decoding on the GPU against the CPU's, and a CUDA out-of-memory ending
in one `error:` line.

MINIGPT_GPU_TESTS=cpu runs the same tests on the CPU (bf16 autocast there too), to check the tests' own logic
on a machine without a GPU.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minigpt.cli.main import app
from minigpt.common.files import load_tensors
from minigpt.data.dataset import DataConfig
from minigpt.generate.decode import Generation
from minigpt.generate.load import load_engine
from minigpt.runs.folder import RunDir
from minigpt.train.loop import TrainConfig, train

DEVICE = os.environ.get("MINIGPT_GPU_TESTS", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"
)
# cuBLAS picks among reduction orders per workspace unless told one (read when its handle is made)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n"
    for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 60)
)
# bf16 keeps 8 significant bits: each operand of a matrix product is rounded by at most u = 2**-8 of itself,
# so each product term by 2u, and a logit's path goes through 6 products per layer (q, k, v, the scores, the
# weighted values and the output projection count as the attention's; the MLP's two) plus the head. The
# errors add along the path: |Δlogit| <= 2u x products x max|logit|, the tolerance used below.
BF16_U = 2.0**-8
F32_U = 2.0**-24


def bf16_bound(n_layer: int, logits: np.ndarray) -> float:
    return 2 * BF16_U * (6 * n_layer + 2) * float(np.abs(logits).max())


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def gpu_cfg(**kw: Any) -> TrainConfig:
    """A small bf16 run on the GPU: 2 layers, 64 wide, block 64."""
    base = dict(
        preset="tiny", batch_size=8, eval_iters=2, eval_every=10, log_every=1, max_iters=40, warmup=4,
        device=DEVICE, dtype="bfloat16", lr=3e-3,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw}, overrides={"n_embd": 64, "block_size": 64})


def losses(result: Any) -> list[float]:
    return [r["loss"] for r in result.metrics if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "optimizer", "compiled"),
    [
        ("gpt2", "adamw", False),
        ("gpt2", "muon", False),
        ("modern", "adamw", False),
        ("modern", "muon", False),
        ("gpt2", "adamw", True),
        ("modern", "muon", True),
    ],
)
def test_bf16_training_learns_and_compiled_steps_start_where_eager_ones_do(
    text_file: Path, tmp_path: Path, arch: str, optimizer: str, compiled: bool
) -> None:
    """40 bf16 steps on the GPU lower the loss by a third; the weights stay float32 (autocast) and finite.
    Compiled, the first step's loss (same seed, same batch, same weights) is the eager one's within bf16's
    error: |Δloss| <= 2 max|Δlogit| (the log-sum-exp and the picked logit each move by at most that)."""
    data = DataConfig(paths=(text_file,), cache_dir=tmp_path / "cache", tokenizer="char")
    cfg = gpu_cfg(arch=arch, optimizer=optimizer, compile=compiled)
    result = train(cfg, data, out=tmp_path / "run")
    seen = losses(result)
    assert len(seen) == 40 and all(np.isfinite(seen)), seen
    assert np.mean(seen[-5:]) < 0.67 * seen[0], seen
    tensors, _ = load_tensors(tmp_path / "run" / RunDir.WEIGHTS)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())
    if compiled:
        eager = train(gpu_cfg(arch=arch, optimizer=optimizer, max_iters=1), data, out=tmp_path / "eager")
        first = losses(eager)[0]
        # at initialisation every logit is within a few hundredths of zero: bound it by the loss's scale
        assert abs(seen[0] - first) <= 2 * bf16_bound(2, np.array([first])), (seen[0], first)


def _stop_at(step: int) -> Any:
    def on_step(now: int) -> None:
        if now == step:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


@pytest.fixture
def deterministic() -> Any:
    """torch's deterministic kernels where it has them, and attention by its math backend: the fused ones (cuDNN's, flash)
    add their backward pass's partial sums in whatever order their blocks finish (torch warns that cuDNN's
    is not deterministic), so two runs would differ in the last bits whether or not one was resumed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)  # the comparison of two runs tells the rest
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _trained_state(path: Path) -> dict[str, torch.Tensor]:
    tensors, _ = load_tensors(path / RunDir.STATE)
    return {k: v for k, v in tensors.items() if k.startswith(("model/", "optim/"))}


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "optimizer"), [("gpt2", "adamw"), ("modern", "muon")])
def test_exact_resume_on_the_gpu(
    text_file: Path, tmp_path: Path, deterministic: None, arch: str, optimizer: str
) -> None:
    """12 bf16 steps straight equal 6, a stop (as Ctrl-C does it), then a resume to 12, bitwise: the
    weights, the optimizer's state and the logged losses. Two straight runs are compared first: the
    resume is held to what the GPU's kernels themselves repeat."""
    data = DataConfig(paths=(text_file,), cache_dir=tmp_path / "cache", tokenizer="char")
    cfg = gpu_cfg(arch=arch, optimizer=optimizer, max_iters=12, eval_every=4)
    straight = train(cfg, data, out=tmp_path / "straight")
    again = train(cfg, data, out=tmp_path / "again")
    first = train(cfg, data, out=tmp_path / "split", on_step=_stop_at(6))
    assert first.interrupted and first.state.step == 6
    resumed = train(TrainConfig(), resume=tmp_path / "split")
    assert resumed.state.step == 12 and not resumed.interrupted
    a, b, c = (_trained_state(tmp_path / name) for name in ("straight", "again", "split"))
    repeat = {k for k in a if not torch.equal(a[k], b[k])}
    assert not repeat, f"two straight runs differ in {sorted(repeat)[:3]}: the GPU's kernels do not repeat"
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    assert not differ, f"the resumed run differs in {differ[:3]}"
    assert losses(straight)[6:] == losses(resumed)[-6:]
    assert losses(straight) == losses(again)


@pytest.fixture(scope="module")
def decoding_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer model trained on the CPU in float32 until its next-token choices are clear (a periodic text)."""
    tmp = tmp_path_factory.mktemp("decoding")
    (tmp / "text.txt").write_text(TEXT, encoding="utf-8")
    cfg = TrainConfig(
        preset="tiny", batch_size=16, max_iters=150, eval_every=150, eval_iters=1, warmup=10, device="cpu",
        dtype="float32", arch="gpt2", optimizer="adamw", lr=1e-2,
        overrides={"n_embd": 64, "block_size": 64},
    )  # fmt: skip
    data = DataConfig(paths=(tmp / "text.txt",), cache_dir=tmp / "cache", tokenizer="char")
    train(cfg, data, out=tmp / "run")
    return tmp / "run"


PROMPT = "alpha the quick"


def _greedy(run: Path, device: str, dtype: str, tokens: int = 48) -> tuple[list[int], list[int], Any]:
    """Prompt ids, the greedy continuation and the torch engine that made it."""
    engine, tokenizer = load_engine(run, "torch", device=device, dtype=dtype)
    prompt = tokenizer.encode(PROMPT)
    gen = Generation(engine, tokenizer, prompt, max_new_tokens=tokens, temperature=0.0)
    (sample,) = gen.run()
    return prompt, sample.token_ids, engine


def _logits(engine: Any, ids: list[int]) -> np.ndarray:
    """Every position's logits of `ids` in one uncached pass, as float64 on the CPU."""
    return engine.forward([ids], None, every_position=True)[0].double().cpu().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_on_the_gpu_gives_the_cpus_greedy_tokens(decoding_run: Path, dtype: str) -> None:
    """The GPU's KV-cached greedy tokens equal the CPU's float32 ones wherever the CPU's best token leads
    the runner-up by more than the two sides' logits may differ; the logits of the CPU's text are within
    that bound: twice float32's depth x u x scale (tests/numerics.py), or bf16's 2u per product (above)."""
    from numerics import float32_bound

    prompt, cpu_tokens, cpu = _greedy(decoding_run, "cpu", "float32")
    _, gpu_tokens, gpu = _greedy(decoding_run, DEVICE, dtype)
    ids = prompt + cpu_tokens
    ref, got = _logits(cpu, ids), _logits(gpu, ids)
    config = cpu.model.config
    bound = 2 * float32_bound(config, ref) if dtype == "float32" else bf16_bound(config.n_layer, ref)
    assert np.abs(got - ref).max() <= bound, (np.abs(got - ref).max(), bound)
    # the continuation is decided at positions len(prompt) - 1 onwards
    top2 = np.sort(ref[len(prompt) - 1 : -1], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound
    decided = int(np.argmin(clear)) if not clear.all() else len(clear)
    assert decided >= 16, f"only {decided} clear choices: the model is too undecided to compare"
    assert gpu_tokens[:decided] == cpu_tokens[:decided]


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA out-of-memory needs CUDA")
def test_a_cuda_out_of_memory_is_one_error_line(runner, text_file: Path, tmp_path: Path) -> None:
    """A training step larger than the memory torch may take (capped at 1% of the card, about 1.4 GB on an
    H200: the estimate before allocating reads the card's free memory, so the allocator's own error is
    what stops it) ends in one `error:` line naming CUDA memory and the option that shrinks the step."""
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.01)
    try:
        args = ["train", str(text_file), "--device", "cuda", "--tokenizer", "char", "--n-layer", "4"]
        args += ["--n-embd", "1024", "--n-head", "8", "--block-size", "512", "--batch-size", "64"]
        args += ["--max-iters", "2"]
        result = runner.invoke(app, [*args, "--out", str(tmp_path / "run")])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.exit_code == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "out of memory" in errors[0] and "CUDA" in errors[0] and "--batch-size" in errors[0], errors


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's free memory needs CUDA")
def test_a_model_larger_than_the_gpus_free_memory_is_refused_before_allocating(
    runner, text_file: Path, tmp_path: Path
) -> None:
    """Weights, gradients and AdamW's moments (16 bytes a parameter) beyond the card's free memory: one line
    with both numbers, before anything is allocated on the GPU."""
    free = torch.cuda.mem_get_info()[0]
    layers = free // (16 * 12 * 4096**2) + 1  # 12 C² parameters a layer
    before = torch.cuda.memory_allocated()
    args = ["train", str(text_file), "--device", "cuda", "--tokenizer", "char", "--n-layer", str(layers)]
    args += ["--n-embd", "4096", "--n-head", "32", "--max-iters", "1", "--out", str(tmp_path / "run")]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "GiB of GPU memory but" in line and "GiB is free" in line and "--n-layer" in line, line
    assert torch.cuda.memory_allocated() == before
