"""`minigpt serve` for evaluation harnesses and batch clients: several prompts per request (strings or token
ids), echo, scoring a prompt without generating (max_tokens 0), against the model, `minigpt eval` and
transformers on the export."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")

from test_serve import FIXTURE, KEY, PROMPT, Server, reference, request  # noqa: E402

from minigpt.cli.main import app  # noqa: E402
from minigpt.generate.decode import Sampling, encode_prompt  # noqa: E402
from minigpt.generate.load import load_engine  # noqa: E402
from minigpt.runs.folder import RunDir  # noqa: E402
from minigpt.serve.batcher import Batcher, Job, TokenLogprob, Update  # noqa: E402

torch.set_num_threads(1)


def model_logprobs(run: Path, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1 by one full forward pass of the torch model, in float64."""
    model = RunDir(run).load_model()[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), all_logits=True)[0][0].double()
    logp = torch.log_softmax(logits, -1)
    return np.array([logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0])


# --- the batcher, without a server -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_prompt_scores_are_the_models(backend: str) -> None:
    """Echoed prompts with logprobs and max_tokens 0: each token's log-probability given the ones before (the
    first has none), the top alternatives, offsets; prompts of one length scored together."""
    engine, tok = load_engine(FIXTURE, backend)
    batcher = Batcher(engine, tok)
    prompts = ["The dog", "Lazy a", "To be or not.", "The fox"]  # two of 7 characters
    got: dict[int, list[TokenLogprob]] = {}
    finished: list[str | None] = []

    def notify(update: Update) -> None:
        for piece in update.pieces:
            got.setdefault(piece.index, []).extend(piece.logprobs)
            if piece.finish_reason:
                finished.append(piece.finish_reason)

    jobs = [
        Job(encode_prompt(tok, p), n=1, max_tokens=0, sampling=Sampling(), logprobs=3, echo=p, first_index=i,
            notify=notify)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    batcher.submit(*jobs)
    batcher.step()
    assert batcher.forwards == 0 and batcher.active_rows == 0 and not batcher.groups  # nothing to generate
    assert finished == ["length"] * 4 and all(job.done for job in jobs)
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        entries = got[i]
        assert [e.token for e in entries] == list(prompt) and [e.offset for e in entries] == list(
            range(len(ids))
        )
        assert entries[0].logprob is None and entries[0].top is None
        expected = model_logprobs(FIXTURE, ids)
        np.testing.assert_allclose([e.logprob for e in entries[1:]], expected, rtol=0, atol=1e-5)
        for e in entries[1:]:
            assert len(e.top) == 3 and max(e.top.values()) >= e.logprob


def test_prompts_of_one_request_decode_together() -> None:
    """A request's prompts are jobs admitted together: those of one length are prefilled in one forward
    pass and stepped as one batch, each giving what `minigpt generate` gives for it alone."""
    engine, tok = load_engine(FIXTURE, "numpy")
    batcher = Batcher(engine, tok)
    prompts = ["The dog", "Lazy a", "The fox"]
    texts = [""] * 6
    jobs = []
    for i, p in enumerate(prompts):
        job = Job(
            encode_prompt(tok, p),
            n=2,
            max_tokens=20,
            sampling=Sampling(0.8, None, None, 5),
            first_index=2 * i,
        )
        job.notify = lambda u: [texts.__setitem__(x.index, texts[x.index] + x.text) for x in u.pieces]
        jobs.append(job)
    batcher.submit(*jobs)
    batcher.step()
    assert batcher.forwards == 2 and batcher.rows_forwarded == 6  # "The dog" and "The fox" as one batch
    while batcher.groups or batcher.waiting:
        batcher.step()
    for i, p in enumerate(prompts):
        assert texts[2 * i : 2 * i + 2] == reference(p, 20, n=2, temperature=0.8, seed=5), p


# --- through a server and the official client ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(FIXTURE, root / "tiny")
    s = Server(root, str(root / "tiny"), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.slow
def test_several_prompts_in_one_request(client: openai.OpenAI) -> None:
    """What langchain's batch() and lm-evaluation-harness send: a list of strings, a list of token ids, a
    list of lists of token ids; choices come prompt by prompt, n each, as separate requests would."""
    prompts = ["The dog", "Lazy a", "To be"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=15, n=2, temperature=0.9, seed=4)
    assert [c.index for c in out.choices] == list(range(6))
    expected = [t for p in prompts for t in reference(p, 15, n=2, temperature=0.9, seed=4)]
    assert [c.text for c in out.choices] == expected
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 90
    tok = RunDir(FIXTURE).tokenizer()
    ids = [tok.encode(p) for p in prompts]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=15, n=2, temperature=0.9, seed=4)
    assert [c.text for c in by_ids.choices] == expected
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=15, temperature=0.9, seed=4)
    assert one.choices[0].text == reference(prompts[0], 15, temperature=0.9, seed=4)[0]
    streamed = [""] * 6
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=15, n=2, temperature=0.9, seed=4, stream=True
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == expected


@pytest.mark.slow
def test_echo(client: openai.OpenAI) -> None:
    """echo: the prompt, then the completion; with logprobs the prompt's tokens first, the first null."""
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == list(PROMPT) and lp.text_offset == list(range(len(PROMPT)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = RunDir(FIXTURE).tokenizer().encode(PROMPT)
    np.testing.assert_allclose(lp.token_logprobs[1:], model_logprobs(FIXTURE, ids), atol=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])

    both = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, echo=True, logprobs=1, temperature=0
    )
    text = both.choices[0].text
    assert text == PROMPT + reference(PROMPT, 10, temperature=0.0)[0]
    lp = both.choices[0].logprobs
    assert "".join(lp.tokens) == text and lp.text_offset == list(range(len(text)))
    assert lp.token_logprobs[: len(PROMPT)][1:] == scored.choices[0].logprobs.token_logprobs[1:]
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, echo=True, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == text
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    empty = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert empty.choices[0].text == "" and empty.usage.completion_tokens == 0


@pytest.mark.slow
def test_served_loglikelihood_is_evals_and_transformers(default_run: Path, tmp_path: Path, runner) -> None:
    """The log-likelihood the server gives a text (echo, logprobs, max_tokens 0, what lm-evaluation-harness
    asks for) is `minigpt eval`'s loss on that text, and transformers' on the Hugging Face export, to 1e-4 per
    token."""
    transformers = pytest.importorskip("transformers")
    text = "gamma the quick brown fox jumps over the lazy dog 5, said 'gamma'.\n你好 the quick"
    tok = RunDir(default_run).tokenizer()
    ids = tok.encode(text)
    assert 8 < len(ids) <= 64  # one window of the run's context: eval scores every token after the first
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    result = runner.invoke(app, ["eval", str(default_run), str(tmp_path / "text.txt"), "--json"])
    assert result.exit_code == 0, result.output
    evaluated = json.loads(result.stdout)
    assert evaluated["tokens"] == len(ids) - 1

    s = Server(tmp_path, str(default_run))
    try:
        status, body = request(
            s.url + "/v1/completions", {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}
        )
        status_ids, body_ids = request(
            s.url + "/v1/completions", {"prompt": [ids], "echo": True, "logprobs": 0, "max_tokens": 0}
        )
    finally:
        s.stop()
    assert status == status_ids == 200, body
    served = body["choices"][0]["logprobs"]["token_logprobs"]
    assert served[0] is None and len(served) == len(ids)
    assert body_ids["choices"][0]["logprobs"]["token_logprobs"] == served
    per_token = np.array(served[1:])
    assert abs(-per_token.mean() - evaluated["loss"]) <= 1e-4

    assert runner.invoke(app, ["convert", "to-hf", str(default_run), str(tmp_path / "hf")]).exit_code == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"]
    assert hf_ids == ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    theirs = np.array([logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0])
    np.testing.assert_allclose(per_token, theirs, rtol=0, atol=1e-4)
    assert math.isfinite(per_token.sum())


@pytest.mark.slow
def test_scoring_errors(server: Server) -> None:
    for body, message in (
        ({"prompt": [[5, 10**6]], "echo": True, "max_tokens": 0}, "not in this model's vocabulary"),
        ({"prompt": "Üx", "echo": True, "max_tokens": 0}, "never saw"),
        ({"prompt": [1], "logprobs": 6}, "less than or equal to 5"),
    ):
        status, out = request(server.url + "/v1/completions", {"model": "tiny", **body})
        assert status == 400 and message in out["error"]["message"], out
