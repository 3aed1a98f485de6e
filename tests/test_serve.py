"""`minigpt serve`: its batcher against the decode loop, then a real server driven by `openai` and raw HTTP."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")

import pydantic  # noqa: E402  (a dependency of fastapi)

from minigpt.cli.main import app  # noqa: E402
from minigpt.cli.main import serve as serve_command  # noqa: E402
from minigpt.generate.decode import Generation, Sampling, encode_prompt  # noqa: E402
from minigpt.generate.load import load_engine  # noqa: E402
from minigpt.model.config import GPTConfig  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.serve.batcher import Batcher, Job, QueueFull, Update  # noqa: E402
from minigpt.serve.chat import ChatRequest  # noqa: E402
from minigpt.serve.protocol import CompletionRequest  # noqa: E402
from minigpt.tokenizer.char import CharTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "run-v0.1-char"
KEY = "sk-test-key"
PROMPT = "The dog"  # the fixture's char tokenizer knows only the letters of its corpus
HOLD = 1_000_000  # tokens a request may ask of `small`: far more than the tiny model decodes in a test


# --- a real server process -------------------------------------------------------------------------------


class Server:
    """`python -m minigpt serve ARGS --port 0` in a process of its own. A thread reads its output as it
    comes (a pipe that nobody reads would fill and stall it) into `lines`; the URL is taken from the line
    that announces it, so nothing waits on a timer."""

    def __init__(self, tmp: Path, *args: str, preexec_fn: Callable[[], None] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIGPT_API_KEY": ""}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minigpt", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp, text=True, preexec_fn=preexec_fn,
        )  # fmt: skip
        self.lines: list[str] = []
        self.announced: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        url = self.announced.get(timeout=300)  # a hang guard only: the line or the end of output comes first
        if url is None:
            raise AssertionError(f"the server exited: {''.join(self.lines)}")
        self.url = url

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"serving on (http://\S+?)/ ", line)
            if found:
                self.announced.put(found.group(1))
        self.announced.put(None)

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name in ("tiny", "other"):
        shutil.copytree(FIXTURE, root / name)
    return root


@pytest.fixture(scope="module")
def server(runs: Path) -> Iterator[Server]:
    s = Server(
        runs, str(runs / "tiny"), "--model", str(runs / "other"), "--api-key", KEY, "--max-tokens", "256"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small(runs: Path) -> Iterator[Server]:
    """One decoding row and one waiting place: the third concurrent request is turned away (requests may ask
    for HOLD tokens: a row held that long is held until its client leaves, however fast the decoding)."""
    s = Server(runs, str(runs / "tiny"), "--max-batch", "1", "--queue", "1", "--max-tokens", str(HOLD))
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def request(url: str, body: Any = None, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON body) of a GET (no body) or a POST of JSON."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference(prompt: str, max_tokens: int, n: int = 1, **sampling: Any) -> list[str]:
    """What `minigpt generate` gives for these settings: the NumPy engine, as the server runs by default."""
    engine, tok = load_engine(FIXTURE, "numpy")
    gen = Generation(
        engine, tok, encode_prompt(tok, prompt), max_new_tokens=max_tokens, num_samples=n, **sampling
    )
    return [s.text for s in gen.run()]


# --- the batcher, without a server -----------------------------------------------------------------------


def collecting_job(
    prompt: str, n: int, max_tokens: int, temperature: float, seed: int
) -> tuple[Job, list[str]]:
    tok = load_engine(FIXTURE, "numpy")[1]
    texts = [""] * n

    def notify(update: Update) -> None:
        for piece in update.pieces:
            texts[piece.index] += piece.text

    job = Job(encode_prompt(tok, prompt), n=n, max_tokens=max_tokens,
              sampling=Sampling(temperature, None, None, seed), notify=notify)  # fmt: skip
    return job, texts


@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow)])
def test_batched_requests_give_what_generate_gives(backend: str) -> None:
    """Requests decoded together (prompts of five lengths admitted in two rounds, all stepped in one
    forward pass from their second round on, each row at its own position, windows sliding past
    block_size 32 one request at a time) each get exactly the text a lone `Generation` with their
    settings gives."""
    engine, tok = load_engine(FIXTURE, backend)
    batcher = Batcher(engine, tok, max_rows=16)
    cases = [("The dog", 3, 0.8, 1, 80), ("Lazy a", 1, 0.8, 2, 50), ("To be", 2, 0.0, 3, 40),
             ("The foxes", 1, 1.0, 4, 70), ("a", 1, 0.9, 5, 33)]  # fmt: skip
    jobs = [collecting_job(p, n, m, t, s) for p, n, t, s, m in cases]
    for job, _ in jobs[:3]:
        batcher.submit(job)
    batcher.step()  # three prefills (7, 6 and 5 tokens) ...
    batcher.step()  # ... then one group at positions 7, 6 and 5
    assert [len(g.jobs) for g in batcher.groups] == [3] and batcher.forwards == 4
    for job, _ in jobs[3:]:
        batcher.submit(job)
    batcher.step()  # the group's step beside the prefills of "The foxes" (9 tokens) and "a" (1) ...
    batcher.step()  # ... which then join it
    assert [len(g.jobs) for g in batcher.groups] == [5] and batcher.forwards == 8
    while batcher.groups or batcher.waiting:
        batcher.step()
    assert batcher.active_rows == 0
    for (job, texts), (prompt, n, t, seed, m) in zip(jobs, cases, strict=True):
        gen = Generation(
            engine, tok, job.prompt_ids, max_new_tokens=m, num_samples=n, temperature=t, seed=seed
        )
        assert texts == [s.text for s in gen.run()], prompt
        assert [c.tokens for c in job.choices] == [m] * n


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("seed", [0, 1])
def test_requests_arriving_at_random_give_what_generate_gives(backend: str, seed: int) -> None:
    """Fourteen requests of random prompt lengths, sample counts, temperatures and lengths (many past
    block_size 32, so that their windows slide), submitted at random steps, some cancelled, a random room
    of rows: each request that runs to its end gets exactly the text a lone `Generation` gives."""
    draw = random.Random(seed)
    engine, tok = load_engine(FIXTURE, backend)
    batcher = Batcher(engine, tok, max_rows=draw.choice([4, 8, 16]), max_waiting=64)
    words = "the lazy dog jumps over a fox and the foxes, to be or not to be"
    cases = [
        (words[: draw.randint(1, 30)], draw.choice([1, 1, 2, 3]), draw.choice([0.0, 0.7, 1.0]), j,
         draw.randint(1, 90), draw.randint(0, 60), draw.random() < 0.15)
        for j in range(14)
    ]  # fmt: skip
    made = [collecting_job(p, n, m, t, s) for p, n, t, s, m, _, _ in cases]
    step = 0
    while step < 61 or batcher.groups or batcher.waiting:
        for (job, _), (_, _, _, _, _, at, cancel) in zip(made, cases, strict=True):
            if at == step:
                batcher.submit(job)
            if cancel and step == at + 5:
                batcher.cancel(job)
        batcher.step()
        step += 1
    assert batcher.active_rows == 0 and batcher.rows_forwarded > batcher.forwards
    for (job, texts), (_, n, t, s, m, _, cancel) in zip(made, cases, strict=True):
        if not cancel:
            gen = Generation(
                engine, tok, job.prompt_ids, max_new_tokens=m, num_samples=n, temperature=t, seed=s
            )
            assert texts == [sample.text for sample in gen.run()], job.prompt_ids


def test_batcher_queue_and_cancel() -> None:
    engine, tok = load_engine(FIXTURE, "numpy")
    batcher = Batcher(engine, tok, max_rows=2, max_waiting=1)
    first, second, third = (collecting_job("a", 2, 100, 1.0, i)[0] for i in range(3))
    batcher.submit(first)
    batcher.submit(second)  # waits: the two rows are promised to the first
    with pytest.raises(QueueFull):
        batcher.submit(third)
    batcher.cancel(second)  # a waiting job leaves at once
    batcher.submit(third)
    batcher.step()
    assert batcher.active_rows == 2 and batcher.waiting == 1
    batcher.cancel(first)  # an active one at the next step, which admits the next
    batcher.step()
    assert [g.jobs for g in batcher.groups] == [[third]] and batcher.waiting == 0


def test_a_failing_step_ends_its_requests_with_an_error_and_the_worker_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, tok = load_engine(FIXTURE, "numpy")
    batcher = Batcher(engine, tok)
    batcher.start()
    updates: queue.Queue[Update] = queue.Queue()
    job, _ = collecting_job("a", 1, 5, 1.0, 0)
    job.notify = updates.put
    monkeypatch.setattr(engine, "forward", lambda ids, cache: 1 / 0)
    batcher.submit(job)
    failed = updates.get(timeout=300)  # the worker's answer (the timeout only guards against a hang)
    assert failed == Update([], done=True, error="internal error while decoding (see the server log)")
    monkeypatch.undo()
    job, texts = collecting_job("a", 1, 5, 1.0, 0)
    collect = job.notify
    job.notify = lambda update: (collect(update), update.done and updates.put(update))  # type: ignore[func-returns-value]
    batcher.submit(job)
    assert updates.get(timeout=300).done
    batcher.stop()
    assert len(texts[0]) == 5 and batcher.active_rows == 0


def test_logprobs_of_greedy_tokens_are_the_best() -> None:
    engine, tok = load_engine(FIXTURE, "numpy")
    batcher = Batcher(engine, tok)
    job, _ = collecting_job("The", 1, 10, 0.0, 0)
    job.logprobs = 3
    scored = []
    job.notify = lambda u: scored.extend(lp for p in u.pieces for lp in p.logprobs)
    batcher.submit(job)
    while batcher.groups or batcher.waiting:
        batcher.step()
    assert len(scored) == 10
    for lp in scored:
        assert len(lp.top) == 3 and lp.logprob == max(lp.top.values()) <= 0
        assert lp.top[lp.token] == lp.logprob


# --- the OpenAI API through the official client ----------------------------------------------------------


def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    status, health = request(server.url + "/health", key=None)  # no key needed to ask if it is up
    assert status == 200 and health["status"] == "ok"
    assert [m["backend"] for m in health["models"]] == ["numpy", "numpy"]  # CPU float32: no torch needed
    assert [m.id for m in client.models.list().data] == ["tiny", "other"]


def test_completion_is_what_generate_writes(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.8, seed=7)
    assert out.object == "text_completion" and out.model == "tiny"
    assert [c.text for c in out.choices] == reference(PROMPT, 40, temperature=0.8, seed=7)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 40)
    other = client.completions.create(model="other", prompt=[PROMPT], max_tokens=40, temperature=0.8, seed=7)
    assert other.choices[0].text == out.choices[0].text  # the same weights under another name


def test_stream_joins_to_the_same_text(client: openai.OpenAI) -> None:
    settings = dict(model="tiny", prompt=PROMPT, max_tokens=60, temperature=1.0, top_p=0.9, seed=3,
                    extra_body={"top_k": 20})  # fmt: skip
    whole = client.completions.create(**settings).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **settings))
    assert len(chunks) > 10  # it did stream
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 60
    assert whole == reference(PROMPT, 60, temperature=1.0, top_p=0.9, top_k=20, seed=3)[0]


def test_several_samples(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, n=3, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == reference(PROMPT, 30, n=3, seed=11)
    assert len({c.text for c in out.choices}) == 3 and out.usage.completion_tokens == 90
    streamed = ["", "", ""]
    for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, n=3, seed=11, stream=True
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in out.choices]


def test_stop_strings(client: openai.OpenAI) -> None:
    greedy = reference(PROMPT, 40, temperature=0.0)[0]
    stop = greedy[12:15]
    expected = greedy[: greedy.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "Q"],
                                        stream=stream)  # fmt: skip
        choices = [c.choices[0] for c in out] if stream else out.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == 12
    assert all(
        len(top) == 2 and max(top.values()) == p
        for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset == list(range(12))


# --- bad requests and auth -------------------------------------------------------------------------------

BAD = [
    ({"prompt": []}, "prompt", "a list of lists of token ids"),
    ({"prompt": ["one", [1, 2]]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [[1, 2], []]}, "prompt", "none of them empty"),
    ({"prompt": [1, True]}, "prompt", "a list of token ids"),
    ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ({"prompt": 5}, "prompt", "lists of token ids, none of them empty lists, not a number"),
    ({"prompt": 2.5}, "prompt", "not a number"),
    (
        {"prompt": float("inf")},
        None,
        "the request body is not valid JSON (Infinity, which is not a JSON number)",
    ),
    ({"prompt": True}, "prompt", "not a boolean"),
    ({"prompt": None}, "prompt", "not null"),
    ({"prompt": {"text": "a"}}, "prompt", "not an object"),
    ({"prompt": [1, [2, "a"]]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [[1, 2], [True]]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [[[1]]]}, "prompt", "a list of lists of token ids"),
    ({"prompt": ["a", None]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [1.0, 2.0]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [1, 10**6]}, "prompt", "token id 1000000, which is not in this model's vocabulary"),
    ({"prompt": [[1], [2**64]]}, "prompt", "token id 18446744073709551616"),
    ({"prompt": [[1], [-1]]}, "prompt", "token id -1"),
    ({"prompt": [1] * 33}, "prompt", "context is 32 tokens"),
    ({"prompt": "Ünknown"}, "prompt", "never saw"),
    ({"prompt": "a" * 40}, "prompt", "context is 32 tokens"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 33}, "n", "at most 32"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": 10_000}, "max_tokens", "at most 256"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"stop": ["", "x"]}, "stop", "non-empty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"logprobs": 9}, "logprobs", "less than or equal to 5"),
    ({"best_of": 3}, None, "best_of is not supported"),
    ({"max_token": 5}, "max_token", "unrecognized request argument"),
    ({"model": "nope"}, "model", "no model 'nope'"),
    ([1, 2], None, "must be a JSON object"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[str(b)[:30] for b, _, _ in BAD])
def test_bad_requests_are_400_in_openai_shape(
    server: Server, body: Any, param: str | None, message: str
) -> None:
    if isinstance(body, dict):
        body = {"model": "tiny", "prompt": PROMPT, **body}
    status, out = request(server.url + "/v1/completions", body)
    assert status == (404 if param == "model" else 400), out
    assert out["error"]["type"] == "invalid_request_error" and message in out["error"]["message"]
    assert out["error"]["param"] == param or param is None
    assert "Traceback" not in json.dumps(out) and not any("Traceback" in line for line in server.lines)


# any JSON value, as a request body's field may hold
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)


@given(JSON)
def test_any_malformed_prompt_or_message_is_a_validation_error(value: Any) -> None:
    """What FastAPI answers 400: a pydantic ValidationError, never another exception (a 500); and what passes
    is what the decoding takes."""
    try:
        prompts = CompletionRequest.model_validate({"prompt": value}).prompt
        assert all(isinstance(p, str) or (p and all(type(i) is int for i in p)) for p in prompts)
    except pydantic.ValidationError:
        pass
    for messages in (value, [value], [{"role": "user", "content": value}]):
        try:
            request = ChatRequest.model_validate({"messages": messages})
            assert all(isinstance(m.content, str) for m in request.messages)
        except pydantic.ValidationError:
            pass


def test_malformed_json_and_unknown_routes(server: Server, client: openai.OpenAI) -> None:
    status, out = request(server.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and out["error"]["message"].startswith("the request body is not valid JSON (")
    status, out = request(server.url + "/v1/nothing")
    assert status == 404 and "error" in out
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
    assert server.proc.poll() is None


def test_api_key(server: Server) -> None:
    for key in (None, "wrong"):
        for route, body in (
            ("/v1/models", None),
            ("/v1/completions", {"prompt": "a"}),
            ("/v1/runs/tiny", None),
        ):
            status, out = request(server.url + route, body, key=key)
            assert status == 401 and out["error"]["type"] == "authentication_error", route
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="a")
    assert request(server.url + "/health", key=None)[0] == 200


# --- the page's endpoints --------------------------------------------------------------------------------


@pytest.mark.slow
def test_attention_is_what_minigpt_attention_prints(server: Server, runner: Any) -> None:
    status, out = request(
        server.url + "/v1/attention", {"model": "tiny", "text": "The dog jumps", "position": 6}
    )
    assert status == 200
    cli = runner.invoke(
        app, ["attention", "The dog jumps", "--model", str(FIXTURE), "--position", "6", "--json"]
    )
    expected = json.loads(cli.stdout)
    for key in ("dropped", "position", "n_layer", "n_head"):
        assert out[key] == expected[key], key
    for key in ("ids", "tokens"):  # the page gets the whole text's tokens, the CLI those up to the position
        assert out[key][:7] == expected[key] and len(out[key]) == 13
    for got, want in zip(_flat(out["weights"]), _flat(expected["weights"]), strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    status, out = request(server.url + "/v1/attention", {"model": "tiny", "text": "The dog", "position": 9})
    assert status == 400 and "position 9 is out of range" in out["error"]["message"]
    status, out = request(server.url + "/v1/attention", {"model": "tiny", "text": ""})
    assert status == 400 and out["error"]["param"] == "text"


def _flat(x: Any) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def test_run_info(server: Server) -> None:
    status, out = request(server.url + "/v1/runs/other")
    assert status == 200
    assert len(out["metrics"]) == len((FIXTURE / "metrics.jsonl").read_text().splitlines())
    assert out["params"]["exact_total"] == out["summary"]["params"] == 27_840
    assert [r["name"] for r in out["params"]["breakdown"]][0] == "Embedding"


def test_page_and_its_files_are_served_offline(server: Server) -> None:
    with urllib.request.urlopen(server.url + "/", timeout=10) as r:
        page = r.read().decode()
    assert r.headers["content-type"].startswith("text/html")
    files = [f for f in re.findall(r'(?:src|href)="([^"]+)"', page) if f != "data:,"]  # data: the empty icon
    assert files and all(f.startswith("/static/") for f in files)  # nothing from a CDN
    for f in files:
        with urllib.request.urlopen(server.url + f, timeout=10) as r:
            urls = re.findall(r"https?://[^\s\"']*", r.read().decode())
            assert r.status == 200 and set(urls) <= {"http://www.w3.org/2000/svg"}, f  # a name, not a request


# --- load: concurrency, the queue limit, disconnects, memory ---------------------------------------------


@pytest.mark.slow
def test_32_concurrent_streams_finish_with_their_token_counts(server: Server, client: openai.OpenAI) -> None:
    def stream(i: int) -> tuple[int, str]:
        # long enough to overlap however fast the steps: 20 + i tokens were sometimes done before most of the
        # 32 requests had come once a step became one compiled call
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200 + i, seed=i, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        text, used = "", 0
        for c in chunks:
            text += "".join(choice.text for choice in c.choices)
            used = c.usage.completion_tokens if c.usage else used
        return used, text

    def counts() -> tuple[int, int]:
        model = request(server.url + "/health")[1]["models"][0]
        return model["forward_passes"], model["rows_forwarded"]

    passes, rows = counts()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32)))
    for i, (used, text) in enumerate(results):
        assert used == len(text) == 200 + i  # one character per token, no end-of-text in a char model
    passes_after, rows_after = counts()
    assert (rows_after - rows) / (passes_after - passes) > 2  # they shared forward passes


def open_stream(server: Server, max_tokens: int = 256) -> socket.socket:
    """A streaming request on a raw socket, its response headers read (so it has been queued)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.slow
def test_listening_beyond_loopback_without_a_key_warns(runs: Path) -> None:
    """The README: `minigpt serve` warns when it listens elsewhere without a key; on loopback it does not."""
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        s = Server(runs, str(runs / "tiny"), "--host", host)
        s.stop()
        warning = f"warning: listening on {host} without --api-key: anyone who can reach this port can use it"
        assert any(line.startswith(warning) for line in s.lines) == warned, s.lines


@pytest.mark.slow
def test_busy_server_says_429_and_a_client_that_leaves_frees_its_row(small: Server) -> None:
    def load() -> tuple[int, int]:
        model = request(small.url + "/health")[1]["models"][0]
        return model["active_rows"], model["waiting"]

    # one decoding, one waiting; each asks for more tokens than the test could see decoded (256 were done
    # before the third request came once a step became one compiled call)
    first, second = open_stream(small, HOLD), open_stream(small, HOLD)
    status, out = request(small.url + "/v1/completions", {"prompt": PROMPT})
    assert status == 429 and out["error"]["type"] == "rate_limit_error" and "busy" in out["error"]["message"]
    assert load() == (1, 1)
    first.close()  # mid-stream: the waiting request gets the row
    assert second.recv(4096)  # blocks until the second streams: it holds the row now
    second.close()  # mid-stream too: its row is freed at the next step, and the next request served
    assert request(small.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})[0] == 200
    assert load() == (0, 0)


@pytest.mark.slow
def test_memory_stays_flat_over_500_requests(server: Server) -> None:
    def one(i: int) -> int:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "seed": i, "stream": i % 2 == 0}
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status

    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(one, range(50))) == {200}  # warm up: allocators and caches settle
        before = server.rss_mb()
        assert set(pool.map(one, range(500))) == {200}
    growth = server.rss_mb() - before
    assert growth < 50, f"the server grew by {growth:.1f} MB over 500 requests"  # 0.1 MB when measured


# --- start-up problems are one line ----------------------------------------------------------------------


@pytest.mark.slow
def test_startup_errors_are_one_line(runs: Path, tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args, message in (
        ([str(runs / "tiny"), "--port", port], f"cannot listen on 127.0.0.1:{port}"),
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(runs / "tiny"), "--model", str(runs / "tiny")], "two runs are named 'tiny'"),
    ):
        proc = subprocess.run([sys.executable, "-m", "minigpt", "serve", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=60)  # fmt: skip
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    taken.close()


def help_examples() -> list[tuple[list[str], str, dict[str, Any]]]:
    """`serve --help`'s examples: each `minigpt serve` command's arguments, with the URL and body of the curl
    request that follows it."""
    examples: list[tuple[list[str], str, dict[str, Any]]] = []
    waiting: list[list[str]] = []
    for span in re.findall(r"`([^`]*)`", " ".join((serve_command.__doc__ or "").split())):
        if span.startswith("minigpt serve"):
            waiting.append(span.split()[2:])
        elif span.startswith("curl "):
            body = json.loads(re.search(r"-d '(\{.*\})'", span).group(1))
            examples += [(args, span.split()[1], body) for args in waiting]
            waiting = []
    return examples


@pytest.mark.slow
def test_the_help_examples_work(tmp_path: Path) -> None:
    """Each serve command of `serve --help`, then its curl request: runs named as there, whose tokenizer
    knows the prompt, one server alone and two together (where a request must name its run)."""
    examples = help_examples()
    assert [] in [args for args, _, _ in examples] and any("--model" in args for args, _, _ in examples)
    tok = CharTokenizer.from_text("ROMEO: JULIET.")
    for name in ("a", "b"):
        config = GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=1, n_embd=8)
        RunDir(tmp_path / "checkpoints" / name).save(GPT(config), tok, {})
    for args, url, body in examples:
        # the curl goes where that command listens
        port = args[args.index("--port") + 1] if "--port" in args else "8000"
        assert url.startswith(f"localhost:{port}/"), (args, url)
        served = Server(tmp_path, *args)  # on a free port
        try:
            status, out = request(served.url + url.removeprefix(f"localhost:{port}"), body, key=None)
        finally:
            served.stop()
        assert status == 200, (args, body, out)


@pytest.mark.slow
def test_without_the_extra_it_says_how_to_install(runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    result = runner.invoke(app, ["serve", str(FIXTURE)])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: minigpt serve needs FastAPI and uvicorn: pip install 'minigpt[serve]' "
        "(pip install -e '.[serve]' in a checkout)"
    )
