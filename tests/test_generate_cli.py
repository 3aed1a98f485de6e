"""`minigpt generate` through the CLI: text on stdout only, options, streaming, and every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_decode import SCRIPT, ByteTokenizer, bigram_model

from minigpt.cli.main import app
from minigpt.generate.decode import SAMPLE_SEPARATOR
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir
from minigpt.tokenizer.char import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "run-v0.1-char"
CHARS = list("\n !',.:;?ETabcdefghilmnorstuwy")
CONFIG = GPTConfig(vocab_size=len(CHARS), block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


def make_run(path: Path, config: GPTConfig = CONFIG) -> Path:
    torch.manual_seed(0)
    RunDir(path).save(GPT(config), CharTokenizer(CHARS), extra={})
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run")


# every test runs on both engines unless it names one; the auto choice has tests of its own
BACKEND = {"name": "auto"}


@pytest.fixture(autouse=True, params=["numpy", "torch"])
def backend(request, monkeypatch) -> str:
    monkeypatch.setitem(BACKEND, "name", request.param)
    return request.param


def gen(runner, *args: str, **kw):
    chosen = [] if "--backend" in args else ["--backend", BACKEND["name"]]
    return runner.invoke(app, ["generate", *args, *chosen], **kw)


def ok(result) -> str:
    assert result.exit_code == 0, result.stderr
    return result.stdout


def one_line_error(result, exit_code: int, *needles: str) -> str:
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def test_text_goes_to_stdout_and_the_rest_to_stderr(runner, run_dir: Path) -> None:
    result = gen(runner, "the ", "-m", str(run_dir), "-n", "40", "--seed", "1")
    out = ok(result)
    assert len(out) == 40 and set(out) <= set(CHARS)  # char model: one character per token
    assert "tokens/s" in result.stderr and "seed 1" in result.stderr


@pytest.mark.slow
def test_json_output(runner, run_dir: Path) -> None:
    result = gen(runner, "the ", "-m", str(run_dir), "-n", "30", "-s", "3", "--seed", "2", "--json")
    data = json.loads(ok(result))
    assert data["prompt_tokens"] == 4 and data["seed"] == 2 and data["tokens_per_second"] > 0
    assert data["time_to_first_token_s"] > 0 and data["dtype"] == "float32" and data["device"] == "cpu"
    assert len(data["samples"]) == 3
    for sample in data["samples"]:
        assert sample["finish_reason"] == "length" and sample["completion_tokens"] == 30
        assert len(sample["text"]) == 30 and sample["tokens_per_second"] > 0
    plain = ok(gen(runner, "the ", "-m", str(run_dir), "-n", "30", "-s", "3", "--seed", "2"))
    assert plain == SAMPLE_SEPARATOR.join(s["text"] for s in data["samples"])


@pytest.mark.slow
def test_the_kv_cache_type_is_chosen_and_shown(runner, run_dir: Path, backend: str) -> None:
    """`--kv-cache`: auto is float16 on the NumPy engine and the dtype (float32 here) on torch; either type
    by hand on both, shown in --json; a type it does not know is a usage error (exit 2)."""

    def run(*args: str) -> dict:
        return json.loads(ok(gen(runner, "the ", "-m", str(run_dir), "-n", "20", "-t", "0", "--json", *args)))

    assert run()["kv_cache"] == ("float16" if backend == "numpy" else "float32")
    half, full = run("--kv-cache", "float16"), run("--kv-cache", "float32")
    assert (half["kv_cache"], full["kv_cache"]) == ("float16", "float32")
    assert half["samples"][0]["completion_tokens"] == full["samples"][0]["completion_tokens"] == 20
    bad = gen(runner, "the ", "-m", str(run_dir), "--kv-cache", "int8")
    assert bad.exit_code == 2 and "--kv-cache" in bad.stderr


@pytest.mark.slow
def test_seeds_reproduce_and_greedy_ignores_them(runner, run_dir: Path) -> None:
    def text(*args: str) -> str:
        return ok(gen(runner, "a", "-m", str(run_dir), "-n", "50", *args))

    assert text("--seed", "3") == text("--seed", "3")
    assert text("--seed", "3") != text("--seed", "4")
    assert (
        text("-t", "0", "--seed", "3")
        == text("-t", "0", "--seed", "4")
        == text("--top-k", "1", "--seed", "5")
    )


@pytest.mark.slow
def test_streaming_equals_non_streaming_with_samples_that_stop_at_different_times(
    runner, run_dir: Path
) -> None:
    args = ["the ", "-m", str(run_dir), "-n", "60", "-s", "4", "--seed", "6", "-t", "1.5"]
    free = json.loads(ok(gen(runner, *args, "--json")))["samples"]
    stop = free[1]["text"][5:7]
    streamed = gen(runner, *args, "--stop", stop, "--stream")
    plain = gen(runner, *args, "--stop", stop, "--no-stream")
    assert streamed.stdout_bytes == plain.stdout_bytes
    data = json.loads(ok(gen(runner, *args, "--stop", stop, "--json")))
    reasons = [s["finish_reason"] for s in data["samples"]]
    assert reasons[1] == "stop" and stop not in plain.stdout
    assert plain.stdout == SAMPLE_SEPARATOR.join(s["text"] for s in data["samples"])
    for before, after in zip(free, data["samples"], strict=True):
        assert after["text"] == before["text"].split(stop)[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_streaming_multibyte_characters_split_across_tokens(runner, tmp_path: Path, monkeypatch) -> None:
    # a byte-level tokenizer stands in for the bpe one: its tokens end inside UTF-8 characters
    model, tokenizer = bigram_model(), ByteTokenizer()
    monkeypatch.setattr(RunDir, "load_model", lambda self, device="cpu": (model, tokenizer, {}))
    results = {}
    for n in (33, 34, 35, 36):  # ends inside, then just after, the 4-byte emoji
        for mode in ("--stream", "--no-stream"):
            results[n, mode] = gen(runner, "a", "-m", str(tmp_path), "-n", str(n), "-t", "1", mode)
            ok(results[n, mode])
        assert results[n, "--stream"].stdout_bytes == results[n, "--no-stream"].stdout_bytes
    want = (SCRIPT[1:] + SCRIPT * 3).encode()[:36].decode()
    assert results[36, "--stream"].stdout == want and "🎉" in want
    assert results[33, "--stream"].stdout.endswith("\ufffd")  # generation ended inside the emoji
    stopped = gen(runner, "a", "-m", str(tmp_path), "-n", "100", "--stop", "🎉ж", "--stream")
    assert ok(stopped) == "é日 " and "\ufffd" not in stopped.stdout


@pytest.mark.slow
def test_prompt_sources_agree(runner, run_dir: Path, tmp_path: Path) -> None:
    base = ["-m", str(run_dir), "-n", "20", "--seed", "1"]
    want = ok(gen(runner, "to be", *base))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("to be", encoding="utf-8")
    assert ok(gen(runner, "--prompt-file", str(prompt_file), *base)) == want
    assert ok(gen(runner, "-", *base, input="to be")) == want
    # an empty prompt starts from a newline (a char model has no <|endoftext|>)
    assert ok(gen(runner, *base)) == ok(gen(runner, "", *base)) == ok(gen(runner, "\n", *base))


def test_default_model_is_the_latest_run(runner, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    old, new = make_run(tmp_path / "checkpoints" / "old"), make_run(tmp_path / "checkpoints" / "new")
    for f in old.iterdir():  # the newest run is the one that changed last, whichever file changed
        os.utime(f, (1, 1))
    result = gen(runner, "a", "-n", "5")
    ok(result)
    assert f"using {Path('checkpoints') / new.name}" in result.stderr


def test_long_prompt_keeps_the_last_block(runner, run_dir: Path) -> None:
    prompt = "the cat sat on the mat. " * 5
    result = gen(runner, prompt, "-m", str(run_dir), "-n", "10", "-t", "0")
    assert "keeping its last 32" in result.stderr and "120 tokens" in result.stderr
    assert ok(result) == ok(gen(runner, prompt[-32:], "-m", str(run_dir), "-n", "10", "-t", "0"))


@pytest.mark.slow
def test_generation_past_the_context_with_any_slide(runner, run_dir: Path) -> None:
    for slide in ("1", "8", "32"):
        data = json.loads(ok(gen(runner, "a", "-m", str(run_dir), "-n", "100", "--slide", slide, "--json")))
        assert data["samples"][0]["completion_tokens"] == 100


# --- bad input: one line on stderr, non-zero exit ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-n", "0"], "--max-new-tokens"),
        (["-n", "-5"], "--max-new-tokens"),
        (["-s", "0"], "--num-samples"),
        (["-t", "-1"], "temperature"),
        (["-t", "nan"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-k", "0"], "top-k"),
        (["--slide", "0"], "--slide"),
        (["--slide", "33"], "slide"),
        (["--stop", ""], "stop string"),
        (["--json", "--stream"], "--json"),
    ],
)
def test_bad_options(runner, run_dir: Path, args: list[str], needle: str) -> None:
    one_line_error(gen(runner, "a", "-m", str(run_dir), *args), 2, needle)


def test_bad_prompts(runner, run_dir: Path, tmp_path: Path) -> None:
    line = one_line_error(gen(runner, "héllo Zürich", "-m", str(run_dir)), 1, "'Z'", "'é'", "'ü'")
    assert "3 character(s)" in line
    one_line_error(
        gen(runner, "a", "--prompt-file", str(tmp_path / "p.txt"), "-m", str(run_dir)), 2, "not both"
    )
    one_line_error(
        gen(runner, "--prompt-file", str(tmp_path / "nope.txt"), "-m", str(run_dir)), 2, "does not exist"
    )
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    one_line_error(gen(runner, "--prompt-file", str(bad), "-m", str(run_dir)), 1, "not UTF-8")
    one_line_error(gen(runner, "-", "-m", str(run_dir), input=b"caf\xe9"), 1, "standard input", "not UTF-8")


def test_empty_prompt_without_a_newline_to_start_from(runner, tmp_path: Path) -> None:
    torch.manual_seed(0)
    run = tmp_path / "run"
    RunDir(run).save(GPT(GPTConfig(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=8)),
                   CharTokenizer(list("abc")), extra={})  # fmt: skip
    one_line_error(gen(runner, "", "-m", str(run)), 1, "give a prompt")
    assert len(ok(gen(runner, "ab", "-m", str(run), "-n", "3"))) == 3


def test_bad_checkpoints(runner, run_dir: Path, tmp_path: Path) -> None:
    one_line_error(gen(runner, "a", "-m", str(tmp_path / "missing")), 1, "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(gen(runner, "a", "-m", str(tmp_path / "empty")), 1, "not a minigpt run")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    one_line_error(gen(runner, "a", "-m", str(foreign)), 1, "not a minigpt run config")
    weights = run_dir / RunDir.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    one_line_error(gen(runner, "a", "-m", str(run_dir)), 1, "corrupt")
    weights.unlink()
    one_line_error(gen(runner, "a", "-m", str(run_dir)), 1, "missing")
    (run_dir / "config.json").write_text('{"format": "minigpt-run", "mod')
    one_line_error(gen(runner, "a", "-m", str(run_dir)), 1, "corrupt")


def test_no_checkpoints_at_all(runner, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    one_line_error(gen(runner, "a"), 1, "no trained model", "minigpt train")


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device(runner, run_dir: Path) -> None:
    one_line_error(gen(runner, "a", "-m", str(run_dir), "--device", "cuda"), 1, "--device cuda")


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_dtype_option(runner, run_dir: Path) -> None:
    data = json.loads(ok(gen(runner, "a", "-m", str(run_dir), "-n", "5", "--dtype", "bfloat16", "--json")))
    assert data["dtype"] == "bfloat16" and data["samples"][0]["completion_tokens"] == 5


# --- a real process -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_subprocess_stdout_is_exactly_the_text(run_dir: Path, runner, backend: str) -> None:
    args = [
        "generate",
        "the ",
        "-m",
        str(run_dir),
        "-n",
        "25",
        "-s",
        "2",
        "--seed",
        "9",
        "--backend",
        backend,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "minigpt", *args], cwd=ROOT, capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(ok(runner.invoke(app, [*args, "--json"])))
    assert proc.stdout == SAMPLE_SEPARATOR.join(s["text"] for s in data["samples"]).encode()
    assert b"tokens/s" in proc.stderr and b"tokens/s" not in proc.stdout


def test_streaming_equals_non_streaming_with_the_real_bpe_tokenizer(runner, tmp_path: Path) -> None:
    """A byte-level BPE splits multi-byte characters across tokens: the stream still shows whole ones."""
    from minigpt.tokenizer.bpe import BPETokenizer

    text = "naïve café 日本語 🎉 ж " * 40 + "plain ascii words " * 40
    tok = BPETokenizer.train([text], vocab_size=300)
    partial = [
        i
        for i in range(tok.vocab_size)
        if tok.decode_bytes([i]).decode("utf-8", "replace") != tok.decode([i]) or "\ufffd" in tok.decode([i])
    ]
    assert partial  # tokens that are not whole characters on their own, which the stream must hold back
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)
    RunDir(tmp_path / "bpe").save(GPT(config), tok, extra={})
    args = ["日本", "-m", str(tmp_path / "bpe"), "-n", "60", "--seed", "3", "-t", "1.5"]
    streamed, plain = gen(runner, *args, "--stream"), gen(runner, *args, "--no-stream")
    assert ok(streamed).encode() == ok(plain).encode() and streamed.stdout_bytes == plain.stdout_bytes


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_explain_shows_attended_tokens_per_generated_token(runner, run_dir: Path) -> None:
    result = gen(runner, "to be", "-m", str(run_dir), "-n", "5", "-t", "0", "--explain")
    text = ok(result)
    lines = [line for line in result.stderr.splitlines() if "←" in line]
    assert len(lines) == 5 and all("L1 h0:" in line and "%" in line for line in lines)
    assert len(text) == 5  # explanations go to stderr only


@pytest.mark.slow
def test_greedy_shows_no_seed_and_seeds_are_range_checked(runner, run_dir: Path) -> None:
    """-t 0 ignores the seed, so neither the summary nor --json claims one; seeds outside 0..2**63-1 and
    a batch whose KV cache cannot fit are one-line errors before anything is generated."""
    result = gen(runner, "-m", str(run_dir), "-t", "0", "-n", "3", "a")
    assert ok(result) and result.stderr.rstrip().endswith(", greedy") and "seed" not in result.stderr
    data = json.loads(ok(gen(runner, "-m", str(run_dir), "-t", "0", "-n", "3", "--json", "a")))
    assert data["seed"] is None
    data = json.loads(ok(gen(runner, "-m", str(run_dir), "--seed", "5", "-n", "3", "--json", "a")))
    assert data["seed"] == 5
    for seed in ("-1", str(2**63)):
        one_line_error(gen(runner, "-m", str(run_dir), "--seed", seed, "a"), 2, "--seed")
    one_line_error(gen(runner, "-m", str(run_dir), "-s", "1000000000000", "a"), 1, "lower --num-samples")


@pytest.mark.slow
def test_generate_keeps_the_blas_threads_the_environment_gives() -> None:
    """OPENBLAS_NUM_THREADS fixes the NumPy engine's threads (the tuner times counts only without it): the
    compiled kernels' where they run (BLAS, the prefills', then stays on one), else BLAS's."""
    code = (
        "import sys\n"
        "from minigpt.cli.main import main\n"
        f"sys.argv = ['minigpt', 'generate', '-m', {str(FIXTURE)!r}, '-n', '5', '--seed', '1', 'The']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "from threadpoolctl import threadpool_info\n"
        "from minigpt.generate.engines import kernels\n"
        "blas = {i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas'}\n"
        "print(*sorted(blas | {kernels.get_threads()} if kernels.available() else blas), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    for threads in ("1", "2"):
        child = {**env, "OPENBLAS_NUM_THREADS": threads, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=child, cwd=ROOT
        )
        counts = proc.stderr.strip().splitlines()[-1].split()
        assert proc.returncode == 0 and counts[-1] == threads and set(counts) <= {"1", threads}, proc.stderr
        assert f"numpy kernels on cpu, {threads} thread" in proc.stderr
