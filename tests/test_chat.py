"""`minigpt chat`: the session (context, reset, save), the terminal loop through a real pseudo-terminal
(scripted turns, Ctrl-C mid-answer, Ctrl-D), and piped input."""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from minigpt.chat.session import ChatSession
from minigpt.chat.template import ChatTemplate, Message, with_chat_tokens
from minigpt.chat.terminal import interactive, piped
from minigpt.errors import MinigptError
from minigpt.generate.config import GenerateConfig
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.model.config import GPTConfig
from minigpt.tokenizer.char import CharTokenizer

CHARS = list(
    "abcdefghijklmnopqrstuvwxyz ,.?!"
)  # id 0 is "a": a model whose logits are all equal says "aaaa..." greedily


def endless_model(block_size: int = 32) -> tuple[GPTConfig, dict[str, np.ndarray], CharTokenizer]:
    """A rotary model that never ends its turn: its final norm's gain is 0, so every logit is 0 and greedy
    decoding picks id 0, "a", forever (past the context too, at constant cost)."""
    tok = with_chat_tokens(CharTokenizer(CHARS), 0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16,
                       pos="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)  # fmt: skip
    import torch

    from minigpt.model.build import model_tensors
    from minigpt.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
    return config, {k: v.numpy() for k, v in model_tensors(model).items()}, tok


def endless_run(path: Path) -> Path:
    import torch

    from minigpt.model.build import build_model
    from minigpt.runs.folder import RunDir

    config, tensors, tok = endless_model()
    model = build_model(config, {k: torch.from_numpy(v) for k, v in tensors.items()}, path)
    RunDir(path).save(model, tok, {})
    return path


class StoppingEngine(NumpyEngine):
    """The endless model, raising KeyboardInterrupt (as Ctrl-C does) at its `stop_at`-th forward pass."""

    def __init__(self, stop_at: int | None = None, block_size: int = 32) -> None:
        config, tensors, self.tokenizer = endless_model(block_size)
        super().__init__(config, tensors)
        self.stop_at, self.calls = stop_at, 0

    def forward(self, ids: Sequence[Sequence[int]], cache):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return super().forward(ids, cache)


def session(engine: StoppingEngine, n: int = 5, system: str | None = None) -> ChatSession:
    return ChatSession(engine, engine.tokenizer, GenerateConfig(max_new_tokens=n, temperature=0.0), system)


def test_answers_join_the_conversation_and_reset_forgets_it() -> None:
    s = session(StoppingEngine(), system="hi")
    reply = s.ask("hello")
    assert "".join(reply.pieces()) == "aaaaa" and reply.finish_reason == "length"
    reply.close()
    assert s.messages == [Message("system", "hi"), Message("user", "hello"), Message("assistant", "aaaaa")]
    s.reset()
    assert s.messages == [Message("system", "hi")]


def test_old_turns_are_dropped_to_fit_the_context_and_the_system_message_stays() -> None:
    engine = StoppingEngine(block_size=32)
    s = session(engine, n=8, system="hi")  # 24 prompt tokens leave the answer 8
    template = ChatTemplate(engine.tokenizer)
    dropped = []
    for text in ("hola", "ahoy", "yo yo", "hi"):
        reply = s.ask(text)
        dropped.append(reply.dropped)
        seen = template.prompt([s.messages[0], *s.messages[s.first :]])
        assert len(seen) <= 24 and s.first >= 1
        "".join(reply.pieces())
        reply.close()
    # each turn is 2 + 4 or 5 (user) and 2 + 8 (answer) tokens: from the second question on, old ones go
    assert dropped[0] == 0 and sum(dropped) >= 3
    assert len(s.messages) == 9  # the whole conversation is kept, for /save


def test_a_message_too_long_for_the_context_keeps_its_end() -> None:
    s = session(StoppingEngine(block_size=32), n=8)
    reply = s.ask("hi " * 20)
    assert reply.cut == 2 + 60 + 1 - 24
    assert "".join(reply.pieces()) == "a" * 8


def test_ctrl_c_stops_the_answer_not_the_chat(tmp_path: Path) -> None:
    engine = StoppingEngine(stop_at=4)  # the prefill, two steps, then Ctrl-C
    s = session(engine, n=50)
    lines = iter(
        ["hello", "/save " + str(tmp_path / "c.jsonl"), "/reset", "h\u00e9", "again", "/bogus", "/exit", "x"]
    )
    out, err = io.StringIO(), io.StringIO()
    interactive(s, lambda prompt: next(lines), out, err)
    assert out.getvalue().splitlines()[0] == "aaa"  # three tokens came before the interruption
    assert " [stopped]" in err.getvalue() and "(saved 2 messages to" in err.getvalue()
    assert "unknown command '/bogus'" in err.getvalue()
    assert "error: text has 1 character(s) the char tokenizer never saw" in err.getvalue()  # and it went on
    saved = json.loads((tmp_path / "c.jsonl").read_text())
    assert saved == {
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "aaa"}]
    }
    assert s.messages[-1] == Message("assistant", "a" * 50)  # the answer after the reset ran to -n


def test_save_appends_to_jsonl_and_leaves_other_files_alone(tmp_path: Path) -> None:
    s = session(StoppingEngine())
    reply = s.ask("hi")
    "".join(reply.pieces())
    reply.close()
    s.save(tmp_path / "log.jsonl")
    s.save(tmp_path / "log.jsonl")
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MinigptError, match="not a .jsonl file"):
        s.save(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_piped_input_gets_one_answer_per_conversation() -> None:
    s = session(StoppingEngine(), n=3, system="hi")
    lines = [b"hello\n", b"\n", json.dumps({"messages": [{"role": "user", "content": "yo"},
             {"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]}).encode(),
             json.dumps({"prompt": "hola"}).encode()]  # fmt: skip
    out = io.StringIO()
    piped(s, lines, out, "hi", as_json=False)
    assert out.getvalue() == "aaa\naaa\naaa\n"
    out = io.StringIO()
    piped(s, [b"hello"], out, None, as_json=True)
    assert json.loads(out.getvalue()) == {"answer": "aaa", "finish_reason": "length"}
    with pytest.raises(MinigptError, match="standard input, line 2: .*last message must be the user's"):
        piped(s, [b"hi", b'{"prompt": "a", "completion": "b"}'], io.StringIO(), None)
    with pytest.raises(MinigptError, match="line 1: not UTF-8"):
        piped(s, [b"\xff\xfe"], io.StringIO(), None)


# ---------------------------------------------------------------------------------------------- processes


class NotPrinted(AssertionError):
    """The terminal printed no match before the deadline (and is still open)."""


def expect(fd: int, pattern: bytes, seen: bytearray, deadline: float = 120.0) -> None:
    """Read the terminal until `pattern` (a regex) appears in what it printed since the last match."""
    end = time.monotonic() + deadline  # a bound on a hang, not a timing assertion
    while not re.search(pattern, bytes(seen)):
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise NotPrinted(f"no {pattern!r} in {bytes(seen)[-400:]!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"the terminal closed before {pattern!r}: {bytes(seen)[-400:]!r}")
        seen += chunk
    del seen[: re.search(pattern, bytes(seen)).end()]  # type: ignore[union-attr]


def interrupt_at_prompt(fd: int, pattern: bytes, seen: bytearray, tries: int = 10) -> None:
    """Press Ctrl-C at the prompt until `pattern` appears. CPython's readline prints the prompt, then blocks in
    select(): a SIGINT that lands between the two is noted but wakes nothing until the next key (a window of
    microseconds that a loaded machine widens), so a second Ctrl-C is what a person would press too."""
    for attempt in range(tries):
        os.write(fd, b"\x03")
        try:
            expect(fd, pattern, seen, deadline=15.0)  # a bound on the wait, not a timing assertion
            return
        except NotPrinted:
            if attempt == tries - 1:
                raise


def closed(fd: int, deadline: float) -> bool:
    """Read the terminal (a child blocked on writing to a full one would never exit) until the child
    closes it (True) or the deadline passes (False)."""
    end = time.monotonic() + deadline  # a bound on a hang, not a timing assertion
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            return False
        try:
            if not os.read(fd, 4096):
                return True
        except OSError:  # EIO: the child has gone
            return True
    return False


def end_with_ctrl_d(fd: int, pid: int, tries: int = 6) -> int:
    """Press Ctrl-D at the prompt until the chat exits; its exit status. A key that lands while the terminal
    is between two of readline's prompts (back in the kernel's line mode) is dropped, as it would be for a
    person, who presses it again."""
    for _ in range(tries):
        os.write(fd, b"\x04")
        if closed(fd, deadline=20.0):
            return os.waitpid(pid, 0)[1]
    raise AssertionError(f"the chat did not end after Ctrl-D pressed {tries} times")


@pytest.mark.slow
def test_chat_in_a_pseudo_terminal(tmp_path: Path) -> None:
    """Scripted turns through a real terminal: an answer streams, Ctrl-C stops it and the chat goes on,
    /save and /reset work, Ctrl-C at the prompt only says how to leave, Ctrl-D ends with exit code 0."""
    import pty

    run = endless_run(tmp_path / "run")
    saved = tmp_path / "chat.jsonl"
    env = {**os.environ, "TERM": "dumb", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "minigpt", "chat", str(run), "-t", "0", "-n", "100000000"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, with the pseudo-terminal as its controlling terminal
        os.execve(sys.executable, args, env)
    seen = bytearray()
    try:
        expect(fd, rb"Ctrl-C stops an answer", seen)
        expect(fd, rb"> ", seen)
        os.write(fd, b"hello\r")
        expect(fd, b"a" * 200, seen)  # streaming, and far from done
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT
        expect(fd, rb"\[stopped\]", seen)
        expect(fd, rb"> ", seen)
        os.write(fd, f"/save {saved}\r".encode())
        expect(fd, rb"saved 2 messages", seen)
        os.write(fd, b"/reset\r")
        expect(fd, rb"conversation forgotten", seen)
        expect(fd, rb"> ", seen)
        interrupt_at_prompt(fd, rb"Ctrl-D or /exit ends the chat", seen)
        expect(fd, rb"> ", seen)
        status = end_with_ctrl_d(fd, pid)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    record = json.loads(saved.read_text())
    user, assistant = record["messages"]
    assert user == {"role": "user", "content": "hello"}
    assert set(assistant["content"]) == {"a"} and len(assistant["content"]) >= 200


@pytest.mark.slow
def test_chat_with_piped_stdin_prints_only_the_answers(tmp_path: Path) -> None:
    run = endless_run(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-m", "minigpt", "chat", str(run), "-t", "0", "-n", "4"],
        input=b"hello\nhi there\n", capture_output=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"aaaa\naaaa\n"
    # a run without the chat tokens: one line saying how to get them
    plain = tmp_path / "plain"
    import torch

    from minigpt.model.gpt import GPT
    from minigpt.runs.folder import RunDir

    RunDir(plain).save(GPT(GPTConfig(vocab_size=len(CHARS), block_size=8, n_layer=1, n_head=1, n_embd=8)),
                       CharTokenizer(CHARS), {})  # fmt: skip
    del torch
    result = subprocess.run([sys.executable, "-m", "minigpt", "chat", str(plain)], input=b"hi\n",
                            capture_output=True, timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.decode().strip().splitlines()[-1].startswith("error: this run's tokenizer")
