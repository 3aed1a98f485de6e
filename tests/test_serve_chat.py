"""`minigpt serve`'s /v1/chat/completions, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")

from test_serve import FIXTURE, Server, request  # noqa: E402

from minigpt.chat.template import ChatTemplate, Message  # noqa: E402
from minigpt.generate.decode import Generation  # noqa: E402
from minigpt.generate.load import load_engine  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The dog"}]


def chat_run(root: Path) -> Path:
    """The char fixture with the chat tokens (mean rows, as fine-tuning starts): it answers, if poorly."""
    import torch

    from minigpt.runs.folder import RunDir
    from minigpt.train.config import TrainConfig
    from minigpt.train.finetune import full_model, plan_fine_tune

    tokenizer, shape, _ = plan_fine_tune(FIXTURE, TrainConfig(), chat=True)
    RunDir(root / "chat").save(full_model(shape, FIXTURE, torch.device("cpu")), tokenizer, {})
    return root / "chat"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chatruns")
    chat_run(root)
    shutil.copytree(FIXTURE, root / "plain")
    return root


@pytest.fixture(scope="module")
def server(runs: Path) -> Iterator[Server]:
    s = Server(runs, str(runs / "chat"), "--model", str(runs / "plain"), "--max-tokens", "64")
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(runs: Path, max_tokens: int, n: int = 1, **sampling: Any) -> list[str]:
    """The answer `minigpt chat` would give: the run's template, the NumPy engine, the same settings."""
    engine, tok = load_engine(runs / "chat", "numpy")
    template = ChatTemplate(tok)
    ids = template.prompt([Message(m["role"], m["content"]) for m in MESSAGES])
    gen = Generation(engine, tok, ids, max_new_tokens=max_tokens, num_samples=n, stop_ids=template.stop_ids,
                     **sampling)  # fmt: skip
    return [s.text for s in gen.run()]


@pytest.mark.slow
def test_chat_completions_plain_and_streamed_with_the_openai_client(
    client: openai.OpenAI, server: Server, runs: Path
) -> None:
    want = reference(runs, 24, n=2, temperature=0.8, seed=5)
    answer = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_completion_tokens=24, temperature=0.8, seed=5, n=2
    )
    assert [c.message.content for c in answer.choices] == want
    assert all(c.message.role == "assistant" for c in answer.choices)
    assert answer.object == "chat.completion" and answer.usage.completion_tokens <= 48
    stream = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=24, temperature=0.8, seed=5, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, roles, finished = ["", ""], set(), set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles |= {c.delta.role} if c.delta.role else set()
            finished |= {c.index} if c.finish_reason else set()
    assert texts == want and roles == {"assistant"} and finished == {0, 1}
    assert chunk.usage is not None and chunk.usage.completion_tokens == answer.usage.completion_tokens


def test_greedy_answers_stop_and_logprobs(client: openai.OpenAI, server: Server, runs: Path) -> None:
    (want,) = reference(runs, 30, temperature=0.0)
    answer = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=30, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = answer.choices[0]
    assert choice.message.content == want
    entries = choice.logprobs.content
    assert len(entries) == answer.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.logprob == max(t.logprob for t in e.top_logprobs) for e in entries)  # greedy: the best
    if len(want) > 3:
        stop = want[2:4]
        cut = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=30, temperature=0,
                                             stop=[stop])  # fmt: skip
        assert cut.choices[0].message.content == want[: want.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param, why",
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": []}, "messages", "at least 1"),
        (
            {"messages": [{"role": "user", "content": "The dog " * 40}]},
            "messages",
            "the model's context is 32",
        ),
        ({"messages": MESSAGES, "max_tokens": 65}, "max_tokens", "at most 64"),
        ({"messages": MESSAGES, "top_logprobs": 2}, None, "needs logprobs: true"),
        ({"messages": MESSAGES, "max_token": 5}, "max_token", "unrecognized request argument"),
        ({"messages": [{"role": "user", "content": "\u00e9"}]}, "messages", "never saw"),
        ({"messages": 5}, "messages", "valid list"),
        ({"messages": None}, "messages", "valid list"),
        ({"messages": MESSAGES[1]}, "messages", "valid list"),
        ({"messages": [5]}, "messages.0", "valid dictionary"),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
        *[
            ({"messages": [{"role": "user", "content": content}]}, "messages.0.content", "list of text parts")
            for content in (
                None,
                5,
                [],
                ["The dog"],
                {"type": "text", "text": "The dog"},
                [{"type": "text", "text": 5}],
                [{"type": "text"}],
                [{"type": "image_url", "image_url": {"url": "http://x/dog.png"}}],
            )
        ],  # fmt: skip
    ],
)
def test_bad_chat_requests_are_openai_style_400s(
    server: Server, body: dict, param: str | None, why: str
) -> None:
    status, reply = request(server.url + "/v1/chat/completions", {"model": "chat", **body}, key=None)
    assert status == 400, reply
    assert why in reply["error"]["message"] and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"


def test_text_parts_are_the_string_they_join(client: openai.OpenAI, runs: Path) -> None:
    parts = [{"type": "text", "text": "The "}, {"type": "text", "text": "dog"}]
    answers = [
        client.chat.completions.create(
            model="chat", messages=[MESSAGES[0], {"role": "user", "content": content}], max_tokens=8, temperature=0
        ).choices[0].message.content
        for content in (parts, "The dog")
    ]  # fmt: skip
    assert answers == reference(runs, 8, temperature=0.0) * 2


def test_a_run_without_chat_tokens_cannot_chat(server: Server) -> None:
    status, reply = request(
        server.url + "/v1/chat/completions", {"model": "plain", "messages": MESSAGES}, key=None
    )
    assert status == 400 and reply["error"]["param"] == "model"
    assert "no chat tokens" in reply["error"]["message"]
    assert json.dumps(reply).count("Traceback") == 0


@pytest.mark.slow
def test_the_page_chats_with_a_chat_run(server: Server) -> None:
    """The page opens in chat mode for a run with the chat tokens; each answer streams into a bubble and is
    the API's answer to the same conversation and settings, the oldest turns left out once the context (32
    tokens) is full; "New chat" forgets the conversation."""
    pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[dev]'")
    from test_serve_browser import CHROMIUM, DRIVER

    if CHROMIUM is None or DRIVER is None:
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        wait = WebDriverWait(browser, 30)
        browser.get(server.url + "/")
        wait.until(lambda d: d.find_element(By.ID, "mode").get_attribute("value") == "chat")
        for field, value in (("max_tokens", "6"), ("seed", "3")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        conversation: list[dict[str, str]] = []
        for number, turn in enumerate(("The dog", "A fox", "The lazy dog"), 1):
            browser.find_element(By.ID, "prompt").send_keys(turn)
            browser.find_element(By.ID, "go").click()
            conversation.append({"role": "user", "content": turn})
            wait.until(lambda d, n=number: len(d.find_elements(By.CSS_SELECTOR, "#log .msg")) == 2 * n)
            wait.until(lambda d: d.find_element(By.ID, "go").text == "Send")
            body = {"model": "chat", "messages": conversation, "max_tokens": 6, "seed": 3, "temperature": 0.8}
            status, reply = request(server.url + "/v1/chat/completions", body, key=None)
            if status == 400:  # the page left the oldest question and answer out, and said so
                assert "no longer fit" in browser.find_element(By.ID, "status").text
                conversation = conversation[2:]
                status, reply = request(
                    server.url + "/v1/chat/completions", {**body, "messages": conversation}
                )
            answer = browser.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")[-1]
            assert answer.get_attribute("textContent") == reply["choices"][0]["message"]["content"]
            conversation.append({"role": "assistant", "content": answer.get_attribute("textContent")})
        assert len(browser.find_elements(By.CSS_SELECTOR, "#log .msg")) == 6  # the page shows them all
        browser.find_element(By.ID, "reset").click()
        assert browser.find_elements(By.CSS_SELECTOR, "#log .msg") == []
    finally:
        browser.quit()
