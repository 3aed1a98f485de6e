"""Memory: estimates against what this process can have, and every failed allocation as one `error:` line.

Allocation failures are real ones where the machine allows it: NumPy and torch asked for 2**62 bytes (more
than any 64-bit address space holds, so they fail whatever the overcommit setting), and whole commands in a
child process under an address-space limit (`ulimit -v`, as a container may set one) whose memory estimate
was told the machine had plenty, so that the allocation itself fails. CUDA's out-of-memory error is raised
by hand with the message torch gives (no GPU here).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT
from typer.testing import CliRunner

from minigpt.cli.main import app
from minigpt.errors import MinigptError
from minigpt.model import memory
from minigpt.model.config import GPTConfig
from minigpt.model.params import count_params
from minigpt.runs.folder import RunDir

FIXTURE = ROOT / "tests" / "fixtures" / "run-v0.1-char"
CORPUS = ROOT / "tests" / "fixtures" / "corpus.txt"
LIMIT = 3 << 30  # the child's address space: torch and NumPy start in it, a 3.8 GiB KV cache does not
TOO_MUCH = 2**62  # bytes: past every 64-bit machine's address space


def numpy_failure() -> None:
    np.empty(TOO_MUCH, dtype=np.uint8)


def torch_cpu_failure() -> None:
    torch.empty(TOO_MUCH, dtype=torch.uint8)


def cuda_failure() -> None:
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
        "1.06 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use."
    )


def python_failure() -> None:
    raise MemoryError()


@pytest.mark.parametrize(
    "fail, size, detail",
    [
        (numpy_failure, "4,294,967,296.00 GiB", "an array of shape (4611686018427387904,) uint8"),
        (torch_cpu_failure, "4,294,967,296.00 GiB", "torch's CPU allocator"),
        (cuda_failure, "2.00 GiB", "CUDA memory"),
        (python_failure, None, ""),
    ],
    ids=["numpy", "torch-cpu", "cuda", "python"],
)
def test_every_kind_of_failed_allocation_is_one_line_naming_what_how_big_and_the_fix(
    runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fail, size: str | None, detail: str
) -> None:
    """Through `minigpt eval`: the evaluation's forward passes fail to allocate. The line names them (the
    label the evaluation put on its allocations), the size the failure reported (Python's MemoryError says
    none, so the line says so), and --batch-size."""
    import minigpt.analysis.evaluate

    monkeypatch.setattr(minigpt.analysis.evaluate, "evaluate_ids", lambda *a, **k: fail())
    result = runner.invoke(app, ["eval", str(FIXTURE), str(CORPUS)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    amount = size or "memory (the size was not reported)"
    detail = f" ({detail})" if detail else ""
    assert lines[0] == (
        f"error: out of memory allocating {amount}{detail} for forward passes over 16 windows of 32 tokens: "
        "lower --batch-size or --max-windows"
    )


def test_sizes_are_read_from_each_kind_of_failure() -> None:
    for fail, nbytes in ((numpy_failure, TOO_MUCH), (torch_cpu_failure, TOO_MUCH), (cuda_failure, 2 << 30)):
        with pytest.raises(BaseException) as caught:
            fail()
        assert memory.is_allocation_failure(caught.value)
        assert memory._failed_allocation(caught.value)[0] == nbytes
    assert memory.is_allocation_failure(MemoryError()) and not memory.is_allocation_failure(RuntimeError("x"))
    assert not memory.is_allocation_failure(ValueError("out of memory"))


def test_the_innermost_label_wins_and_nothing_is_caught_on_the_way() -> None:
    with pytest.raises(MemoryError) as caught:
        with memory.allocating("the outer block", 10):
            with memory.allocating("the KV cache", 2**30, "lower -s"):
                raise MemoryError()
    error = memory.allocation_error(caught.value, "generate")
    assert str(error) == "out of memory allocating 1.00 GiB for the KV cache: lower -s"
    with pytest.raises(ValueError):  # other errors pass through unlabelled
        with memory.allocating("x"):
            raise ValueError("not memory")
    unlabelled = memory.allocation_error(MemoryError(), "train")
    assert str(unlabelled).startswith(
        "out of memory allocating memory (the size was not reported) for minigpt train:"
    )
    assert str(unlabelled).endswith(memory.SMALLER["train"])


def test_available_memory_counts_an_address_space_limit() -> None:
    """Under `ulimit -v` the estimate compares against the address space left, not the machine's memory:
    the case where generate's estimate passed and its allocation then failed."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from minigpt.model import memory\n"
        "print(memory.available_bytes(), memory._address_space_left())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    available, left = map(int, proc.stdout.split())
    assert 0 < available == left < 3 << 30


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_memory_limit_counts_its_droppable_page_cache_as_free(
    tmp_path: Path, version: int
) -> None:
    folder = tmp_path if version == 2 else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")  # fmt: skip
    (folder / names[0]).write_text(f"{4 << 30}\n")
    (folder / names[1]).write_text(f"{3 << 30}\n")
    (folder / "memory.stat").write_text(f"anon 123\n{names[2]} {2 << 30}\n")
    assert memory._cgroup_left(tmp_path) == 3 << 30  # 4 GiB - 3 GiB used + 2 GiB of it droppable cache
    (folder / names[0]).write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")
    assert memory._cgroup_left(tmp_path) is None  # no limit
    assert memory._cgroup_left(tmp_path / "nowhere") is None


def limited(*args: str, fool_the_estimate: bool) -> subprocess.CompletedProcess[str]:
    """`minigpt ARGS` in a child under a 3 GiB address-space limit; with `fool_the_estimate`, its memory
    estimate believes there is a petabyte, so the allocation itself fails (as when the estimate misses
    what a container allows)."""
    code = (
        "import sys\n"
        "from minigpt.model import memory\n"
        + ("memory.available_bytes = lambda: 1 << 50\n" if fool_the_estimate else "")
        + "from minigpt.cli.main import main\n"
        f"sys.argv = ['minigpt', *{list(args)!r}]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)),
    )  # fmt: skip


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1
    return lines[-1]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, size, detail",
    [
        # the NumPy engine's cache is one buffer: 2 layers' keys and values (4 x 1,024,000,000 floats) and
        # 16 to align them; torch's, a tensor a layer: one layer's keys first
        ("numpy", "15.26 GiB", "an array of shape (4096000016,) float32"),
        ("torch", "3.81 GiB", "torch's CPU allocator"),
    ],
)
def test_generate_past_an_address_space_limit(run: Path, backend: str, size: str, detail: str) -> None:
    """The issue's case: `generate -s 1000000` on a model whose KV cache for that many rows is 15.26 GiB."""
    args = (
        "generate",
        "-m",
        str(run),
        "-s",
        "1000000",
        "-n",
        "31",  # the cache holds the prompt's 1 and 31 new positions: the whole block of 32
        "--backend",
        backend,
        "--kv-cache",
        "float32",
        "a",
    )
    estimated = one_error_line(limited(*args, fool_the_estimate=False))
    assert "1,000,000 samples needs about" in estimated and "lower --num-samples" in estimated
    failed = one_error_line(limited(*args, fool_the_estimate=True))
    # a layer's keys: 1,000,000 rows x 2 heads x 32 positions x 16 dimensions x 4 bytes
    assert failed == (
        f"error: out of memory allocating {size} ({detail}) for the KV cache and activations of 1,000,000 "
        "rows: lower -s/--num-samples"
    )


@pytest.mark.slow
def test_a_training_step_past_an_address_space_limit(tmp_path: Path) -> None:
    args = ("train", str(CORPUS), "--preset", "tiny", "--block-size", "256", "--batch-size", "8192",
            "--max-iters", "1", "--device", "cpu", "--out", str(tmp_path / "out"))  # fmt: skip
    failed = one_error_line(limited(*args, fool_the_estimate=True))
    assert failed.startswith("error: out of memory allocating "), failed
    assert "(torch's CPU allocator) for a training step on 8,192 x 256 tokens" in failed
    assert failed.endswith(memory.SMALLER["train"])
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_training_bytes_grow_with_the_batch() -> None:
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    assert memory.training_bytes(config, 8) - memory.training_bytes(config, 4) == memory.activation_bytes(
        config, 4
    )
    with pytest.raises(MinigptError, match="needs about .* GiB of memory but"):
        memory.check_fits(1 << 62, "x", "y")


def test_a_gpu_runs_state_is_checked_against_the_cards_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA device the weights, gradients and AdamW's moments (16 bytes a parameter) are held to the
    card's free memory, not the host's (a GPU's activations are left to its allocator's one-line error)."""
    from types import SimpleNamespace

    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    assert memory.state_bytes(config) == 16 * count_params(config).exact_total
    monkeypatch.setattr(memory, "available_bytes", lambda: pytest.fail("the host's memory was read"))
    monkeypatch.setattr(memory, "cuda_free_bytes", lambda device: 3 << 30)
    gpu = SimpleNamespace(type="cuda")
    memory.check_fits(3 << 30, "x", "y", gpu)
    with pytest.raises(MinigptError, match=r"^x needs about 4\.0 GiB of GPU memory but 3\.0 GiB is free: y$"):
        memory.check_fits(4 << 30, "x", "y", gpu)


def test_training_on_a_gpu_checks_the_card_before_building_the_model(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`minigpt train` on a CUDA device (faked: torch's device object, 3 GiB free) refuses a model whose
    state needs 6 GiB in one line, before building it, without asking the host's memory."""
    from minigpt.train import run as trainsetup

    monkeypatch.setattr(trainsetup, "resolve_device", lambda name, local_rank=0: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(memory, "cuda_free_bytes", lambda device: 3 << 30)
    monkeypatch.setattr(memory, "available_bytes", lambda: pytest.fail("the host's memory was read"))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 300, encoding="utf-8")
    args = ["train", str(text), "--tokenizer", "char", "--n-layer", "2", "--n-embd", "4096", "--n-head", "32"]
    result = runner.invoke(app, [*args, "--max-iters", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1, (result.stderr, result.exception)
    assert result.stderr.splitlines()[-1] == (
        "error: the model's state (weights, gradients, AdamW's moments) needs about 6.0 GiB of GPU memory but "
        "3.0 GiB is free: pick a smaller model (--preset, --n-layer, --n-embd)"
    )
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.parametrize("window, pattern", [(None, "S"), (8, "S"), (8, "SL"), (32, "S")])
@pytest.mark.parametrize("capacity", [None, 1, 5, 8, 20, 32, 100])
def test_the_kv_cache_estimate_is_what_both_engines_allocate(
    window: int | None, pattern: str, capacity: int | None
) -> None:
    """kv_cache_bytes for `capacity` positions (a generation's prompt and new tokens) against the bytes
    torch's model and the NumPy engine allocate for that cache, windows and all (32: a window as long as the block)."""
    from minigpt.generate.engines.numpy_engine import NumpyEngine
    from minigpt.model.build import model_tensors
    from minigpt.model.gpt import GPT

    config = GPTConfig(
        vocab_size=16, block_size=32, n_layer=3, n_head=2, n_embd=16, pos="rope", window=window,
        window_pattern=pattern,
    )  # fmt: skip
    model = GPT(config)
    cache = model.new_cache(3, capacity=capacity)
    torch_bytes = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert memory.kv_cache_bytes(config, 3, 4, capacity) == torch_bytes
    weights = {k: v.detach().float().numpy() for k, v in model_tensors(model).items()}
    kernels = NumpyEngine(config, weights, kv_cache="float16").new_cache(3, capacity)
    assert memory.kv_cache_bytes(config, 3, 2, capacity) == sum(a.nbytes for a in (*kernels.k, *kernels.v))


def test_generate_checks_the_cache_its_generation_reaches(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-s 1000 checks the KV cache of the positions its rows reach (a 1-token prompt and -n new tokens),
    not a whole block's for every row: a memory between the two refuses -n 31 (the block of 32) in one
    line and generates -n 3."""
    config = RunDir(run).model_config()
    short, full = (memory.kv_cache_bytes(config, 1000, 2, n) for n in (4, 32))
    monkeypatch.setattr(memory, "available_bytes", lambda: (short + full) // 2)
    args = ["generate", "-m", str(run), "-s", "1000", "--backend", "numpy", "--kv-cache", "float16", "-n"]
    refused = CliRunner().invoke(app, [*args, "31", "a"])
    assert refused.exit_code == 1 and "1,000 samples needs about" in refused.output, refused.output
    done = CliRunner().invoke(app, [*args, "3", "a"])
    assert done.exit_code == 0, done.output
