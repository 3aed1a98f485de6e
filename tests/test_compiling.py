"""The NumPy engine's kernels compiled in the background (minigpt/generate/engines/compiling.py): when a load
takes them up at once, decodes without them while another process compiles them, or says in one line why it
decodes without them; an engine taking them up between generations, with the same text; what numba's cache
must hold (`kernels.entries`); the compiling process's lock and failure record; a fresh install's first
`generate`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numba
import numpy as np
import pytest
from numba.core.typing.typeof import Purpose
from test_decode import GREEDY, TINY, tiny_model
from test_engines import save

from minigpt.cli.demo import compile_kernels_meanwhile
from minigpt.generate.decode import Generation, Sampling, decode
from minigpt.generate.engines import compiling, kernels
from minigpt.generate.engines.compiling import BACKGROUND, FAILED, Background, main, plan
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.generate.load import NUMPY_KV_CACHE
from minigpt.model.build import model_tensors
from minigpt.tokenizer.char import CharTokenizer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Compile:
    """A compiling process: running until `done`."""

    done: bool = False

    def poll(self) -> int | None:
        return 0 if self.done else None


@dataclass
class Cache:
    """numba's cache as the plan sees it: what it lacks, whether another process holds its lock, and the
    compiles started."""

    lacking: list[str] = field(default_factory=lambda: ["_model_step"])
    locked: bool = False
    started: list[Compile] = field(default_factory=list)
    cannot_start: bool = False

    def background(self, quantize: str, kv_cache: str, folder: Path) -> Background:
        def start() -> Compile:
            if self.cannot_start:
                raise OSError(24, "Too many open files")
            self.started.append(Compile())
            return self.started[-1]

        return Background(quantize, kv_cache, folder, lambda: self.lacking, start, lambda: self.locked)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """numba's cache folder, as `kernels.cache_folder` names it."""
    monkeypatch.setattr(kernels, "cache_folder", lambda: str(tmp_path))
    return tmp_path


def test_kernels_numbas_cache_holds_load_at_once(folder: Path) -> None:
    cache, said = Cache(lacking=[]), []
    assert plan("none", "float16", said.append, cache.background) == (True, None)
    assert said == [] and cache.started == []


def test_lacking_kernels_decode_on_the_array_path_while_another_process_compiles_them(folder: Path) -> None:
    cache, said = Cache(), []
    now, ready = plan("none", "float16", said.append, cache.background)
    assert now is False and ready is not None
    assert said == [BACKGROUND] and len(cache.started) == 1
    assert not ready()  # compiling
    cache.started[0].done, cache.lacking = True, []
    assert ready() and len(cache.started) == 1


def test_a_compile_under_way_elsewhere_is_waited_for_and_one_lacking_after_it_started_again(
    folder: Path,
) -> None:
    cache, said = Cache(locked=True), []
    now, ready = plan("int8", "float32", said.append, cache.background)
    assert now is False and said == [BACKGROUND] and cache.started == []
    assert ready is not None and not ready()
    cache.locked = False  # that process compiled other kernels, or was killed: ours are still lacking
    assert not ready() and len(cache.started) == 1
    cache.started[0].done = True
    assert not ready() and len(cache.started) == 2
    cache.started[1].done = True
    assert not ready() and len(cache.started) == 2  # at most two starts in a process
    cache.lacking = []
    assert ready()


def test_a_compile_that_failed_is_said_in_one_line_and_not_tried_again(folder: Path) -> None:
    ours = {"identity": compiling._identity("none", "float16"), "error": "RuntimeError: boom"}
    (folder / FAILED).write_text(json.dumps(ours))
    cache, said = Cache(), []
    assert plan("none", "float16", said.append, cache.background) == (False, None)
    assert cache.started == [] and len(said) == 1
    assert said[0].startswith("compiling the CPU kernels failed (RuntimeError: boom;")
    assert said[0].endswith("minigpt-kernels.log): decoding without them")
    # a failure of other kernels (int8 weights), or of this source before an edit, is not this one's
    now, _ = plan("int8", "float16", said.append, cache.background)
    assert now is False and said[-1] == BACKGROUND and len(cache.started) == 1


def test_a_compile_that_cannot_start_decodes_without_the_kernels(folder: Path) -> None:
    cache, said = Cache(cannot_start=True), []
    assert plan("none", "float16", said.append, cache.background) == (False, None)
    assert said == ["cannot start compiling the CPU kernels (Too many open files): decoding without them"]


def test_without_a_numba_cache_the_array_path_says_where_to_keep_one(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "cache_folder", lambda: None)
    monkeypatch.setattr(kernels, "caches", lambda: False)
    said: list[str] = []
    assert plan("none", "float16", said.append, Cache().background) == (False, None)
    assert len(said) == 1 and "set NUMBA_CACHE_DIR" in said[0] and said[0].endswith("decoding without them")


def test_the_compiling_process_waits_for_another_compiles_what_is_left_and_records_a_failure(
    folder: Path, monkeypatch, capsys
) -> None:
    """A second compiling process waits for the first's lock, then finds nothing left to compile; loads see
    the lock held meanwhile (`held`) without taking it from a process that asks for it. A failure is
    recorded for these kernels only, said on the last line of the log, and its lock goes with it."""
    store: set[object] = set()
    compiled: list[list[object]] = []

    def compile_entries(wanted: list[object]) -> None:
        compiled.append(list(wanted))
        store.update(wanted)

    monkeypatch.setattr(kernels, "missing", lambda wanted: [w for w in wanted if w not in store])
    monkeypatch.setattr(kernels, "compile_entries", compile_entries)
    waiting = threading.Thread(target=main, args=(["none", "float16"],))
    with compiling.compiling_lock(folder):  # another process compiles
        waiting.start()
        assert compiling.held(folder) and compiled == []
        compile_entries(kernels.entries("none", "float16"))  # ... these kernels
    waiting.join()
    assert not compiling.held(folder) and len(compiled) == 2 and compiled[1] == []
    assert main(["none", "float32"]) == 0  # a float32 KV cache: only the step's types differ
    assert [f.py_func.__name__ for f, _ in compiled[2]] == ["_model_step"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("done: ")

    def fail(wanted: object) -> None:
        raise RuntimeError("boom\nin some numba pass")

    monkeypatch.setattr(kernels, "compile_entries", fail)
    assert main(["int8", "float16"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "failed: RuntimeError: boom"
    assert Background.of("int8", "float16", folder).failure() == "RuntimeError: boom"
    assert Background.of("none", "float16", folder).failure() is None
    assert not compiling.held(folder)


def tensors(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model_tensors(model).items()}


def test_an_engine_takes_up_the_kernels_between_generations_and_generates_the_same_text() -> None:
    """Compiled elsewhere and ready: the next generation runs on the kernels, greedy and seeded text the
    same as on the array path before it and as on an engine that loaded the kernels at once; a cache made
    before goes on through them."""
    model = tiny_model(3)
    ready, said = [False], []
    engine = NumpyEngine(
        TINY,
        tensors(model),
        kv_cache="float16",
        notice=said.append,
        plan=lambda q, kv: (False, lambda: ready[0]),
    )
    direct = NumpyEngine(TINY, tensors(model), kv_cache="float16")
    assert not engine.kernels and engine.path == "array path" and direct.path == "kernels"
    seeded = Sampling(temperature=0.9, seed=4)
    before = [list(decode(engine, [[1, 2, 3]], 30, sampling=s)) for s in (GREEDY, seeded)]
    under_way = engine.new_cache(1)
    engine.forward([[1, 2, 3]], under_way)
    assert not engine.kernels and said == []
    ready[0] = True
    after = [list(decode(engine, [[1, 2, 3]], 30, sampling=s)) for s in (GREEDY, seeded)]
    assert engine.kernels and engine.path == "kernels" and engine.bands
    assert said == ["the CPU kernels are compiled: decoding with them from now on"]
    assert before == after == [list(decode(direct, [[1, 2, 3]], 30, sampling=s)) for s in (GREEDY, seeded)]
    ours, theirs = engine.forward([[4]], under_way), direct.forward([[1, 2, 3, 4]], direct.new_cache(1))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_numbas_cache_holds_what_the_default_commands_load() -> None:
    """The test session compiled the kernels of a command's defaults (conftest): none lacking; an argument
    type never compiled is."""
    assert kernels.missing(kernels.entries("none", "float16")) == []
    never = (kernels._draw, (numba.typeof(np.zeros((1, 1), np.float64), Purpose.argument),) * 4)
    assert kernels.missing([never]) == [never]


@pytest.mark.parametrize(
    ("width", "quantize", "kv_cache"), [(32, "none", "float16"), (40, "int8", "float32")]
)
def test_the_entries_are_the_argument_types_the_engine_calls_the_kernels_with(
    monkeypatch, width: int, quantize: str, kv_cache: str
) -> None:
    """Every call a loaded engine makes into compiled code, over steps, prefills (one row and shared by
    samples), a prompt past the context (the array path's products through the kernels), sampling and rows
    at different positions (a server's), is of a function and argument types `kernels.entries` lists: so a
    compile of those leaves nothing for a load to compile. Bands (width 32) and rows (40)."""
    config = replace(TINY, n_embd=width)
    engine = NumpyEngine(config, tensors(tiny_model(1, config)), quantize=quantize, kv_cache=kv_cache)
    wanted = set(kernels.entries(quantize, kv_cache))
    calls: set[tuple[object, tuple[object, ...]]] = set()
    for name in ("_model_step", "_draw", "_bands", "_matvec", "_qbands"):
        compiled = getattr(kernels, name)

        def call(*args: object, compiled: object = compiled) -> object:
            calls.add((compiled, tuple(numba.typeof(a, Purpose.argument) for a in args)))
            return compiled(*args)

        monkeypatch.setattr(kernels, name, call)
    sampled = Sampling(temperature=0.8, seed=1)
    for prompt, samples, sampling in [
        ([1], 1, GREEDY), ([1, 2, 3], 3, sampled), (list(range(1, 30)), 1, sampled),
        ([1, 2], 2, Sampling(temperature=0.8, top_k=5, seed=1)),
    ]:  # fmt: skip
        list(decode(engine, [prompt], 20, num_samples=samples, sampling=sampling))
    short, longer = engine.new_cache(1), engine.new_cache(1)
    engine.forward([[1]], short), engine.forward([[1, 2, 3]], longer)
    mixed = engine.gather([(short, 0, 1), (longer, 0, 1)])
    engine.sample(engine.forward([[4], [5]], mixed), 0.8, None, None, np.random.default_rng(0))
    assert calls <= wanted, calls - wanted
    assert {f.py_func.__name__ for f, _ in calls} >= {"_model_step", "_draw"}


def last_line(path: Path) -> str:
    lines = path.read_text().splitlines()
    return lines[-1] if lines else ""


def _run(args: list[str], env: dict[str, str], merged: bool) -> subprocess.CompletedProcess[str]:
    """`minigpt ARGS`, its stderr merged into its stdout (in the order written) or apart."""
    return subprocess.run(
        [sys.executable, "-m", "minigpt", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # a compile from nothing, on a busy machine
def test_a_fresh_installs_first_generate_decodes_at_once_and_the_next_on_the_kernels(tmp_path: Path) -> None:
    """With an empty numba cache and minigpt cache: the first `generate` says that the kernels compile in
    the background before its first token, and succeeds on the array path; once that compile is done, the
    next `generate` runs the kernels without compiling anything. The two texts (greedy) are the same."""
    run = save(tmp_path / "run", tiny_model(8))
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
        "MINIGPT_CACHE_DIR": str(tmp_path / "mg"),
    }
    args = ["generate", "-m", str(run), "-n", "12", "-t", "0", "abc"]
    first = _run([*args, "--stream"], env, merged=True)
    assert first.returncode == 0, first.stdout
    # in the order written: the line, then the streamed text (no newline after it in a pipe), the summary
    before, line, after = first.stdout.partition(BACKGROUND + "\n")
    assert line and before == "", first.stdout
    shown = re.fullmatch(r"(.*?)(\d+ tokens in [^\n]*)\n", after, re.DOTALL)
    assert shown is not None and shown[1] and "numpy array path on cpu" in shown[2], first.stdout
    text = shown[1]
    log = next((tmp_path / "numba").rglob(compiling.LOG))
    deadline = time.monotonic() + 600  # a guard against a hung compile, not a measurement
    while not last_line(log).startswith(("done: ", "failed: ")):  # the compiling process's last word
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    assert last_line(log).startswith("done: "), log.read_text()
    second = _run([*args, "--json"], env, merged=False)
    assert second.returncode == 0, second.stderr
    data = json.loads(second.stdout)
    assert data["path"] == "kernels" and "compiling" not in second.stderr, second.stderr
    assert data["samples"][0]["text"] == text


def test_the_demo_starts_the_compile_before_it_trains(monkeypatch) -> None:
    """`minigpt demo`'s first step starts compiling the kernels its generation will load, where numba's
    cache lacks them (here it holds them: conftest)."""
    monkeypatch.setattr("minigpt.generate.load.accelerator_visible", lambda: False)
    started: list[tuple[str, str]] = []
    monkeypatch.setattr(compiling, "spawn", lambda q, kv, folder: started.append((q, kv)) or Compile())
    assert not compile_kernels_meanwhile() and started == []
    monkeypatch.setattr(kernels, "missing", lambda wanted: list(wanted))
    assert compile_kernels_meanwhile() and started == [("none", NUMPY_KV_CACHE)]


def test_the_summary_names_the_path_that_decoded_and_the_load() -> None:
    engine = NumpyEngine(TINY, tensors(tiny_model(2)), kernels=False)
    tokenizer = CharTokenizer([chr(97 + i) for i in range(TINY.vocab_size - 1)] + ["\n"])
    gen = Generation(engine, tokenizer, [1, 2], max_new_tokens=3, temperature=0)
    gen.run()
    summary = gen.summary(1.5)
    assert ", load 1.50 s, numpy array path on cpu," in summary and summary.endswith("), greedy")
    assert gen.to_json()["path"] == "array path" and "load" not in gen.summary()
