"""`minigpt chat`'s loops: a terminal conversation (streamed answers, slash commands, Ctrl-C stops an answer
and Ctrl-D ends the chat), and piped input answered one conversation per line, with nothing else printed.

Answers go to `out` (stdout); notes, the banner and errors to `err` (stderr).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from minigpt.chat.session import ChatSession, conversation_of
from minigpt.errors import MinigptError

HELP = (
    "/reset forgets the conversation, /save FILE appends it to a .jsonl file (the training format), "
    "/help shows this, /exit or Ctrl-D ends the chat; Ctrl-C stops an answer"
)


def interactive(session: ChatSession, read: Callable[[str], str], out: TextIO, err: TextIO) -> None:
    """Chat until Ctrl-D or /exit: each line the user types is a message, answered as it is generated."""
    err.write(f"chatting with a model of context {session.engine.block_size} tokens. {HELP}\n")
    err.flush()
    while True:
        try:
            if not _turn(session, read, out, err):
                return
        except KeyboardInterrupt:  # at the prompt, or between prompts: only an answer is stopped by it
            err.write("\n(Ctrl-D or /exit ends the chat)\n")


def _turn(session: ChatSession, read: Callable[[str], str], out: TextIO, err: TextIO) -> bool:
    """Read one line and act on it; False when the chat ends."""
    try:
        line = read("> ")
    except EOFError:
        out.write("\n")
        return False
    if not line.strip():
        return True
    if line.startswith("/"):
        return _command(session, line, err)
    _answer(session, line, out, err)
    return True


def _command(session: ChatSession, line: str, err: TextIO) -> bool:
    """Run a slash command; False when it ends the chat."""
    try:
        name, *args = shlex.split(line)
    except ValueError as e:
        err.write(f"cannot read that command ({e})\n")
        return True
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        err.write("(conversation forgotten)\n")
    elif name == "/save" and len(args) == 1:
        try:
            session.save(Path(args[0]).expanduser())
            err.write(f"(saved {len(session.messages)} messages to {args[0]})\n")
        except MinigptError as e:
            err.write(f"error: {e}\n")
    elif name == "/help":
        err.write(HELP + "\n")
    else:
        err.write(f"unknown command {line.strip()!r}: {HELP}\n")
    return True


def _answer(session: ChatSession, text: str, out: TextIO, err: TextIO) -> None:
    """Stream the answer to `text`; Ctrl-C stops it, and what was said so far stays in the conversation."""
    try:
        reply = session.ask(text)
    except MinigptError as e:
        err.write(f"error: {e}\n")
        return
    if reply.dropped:
        err.write(
            f"(the context of {session.engine.block_size} tokens is full: the oldest {reply.dropped} "
            f"message(s) no longer fit and are left out)\n"
        )
    if reply.cut:
        err.write(f"(the message is too long for the context: its first {reply.cut} tokens are left out)\n")
    err.flush()
    try:
        for piece in reply.pieces():
            out.write(piece)
            out.flush()
        if reply.finish_reason == "length":
            err.write(f" [cut at {session.settings.max_new_tokens} tokens: -n sets the length]")
    except KeyboardInterrupt:
        err.write(" [stopped]")
    finally:
        reply.close()
    out.write("\n")
    out.flush()


def piped(
    session: ChatSession, lines: Iterable[bytes], out: TextIO, system: str | None, as_json: bool = False
) -> None:
    """Answer each non-blank line (a JSON conversation or a user's message) on its own, one answer a line
    (`as_json`: one JSON object a line, {"answer", "finish_reason"}, for answers that hold newlines)."""
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            messages = conversation_of(_text(raw), system)
        except MinigptError as e:
            raise MinigptError(f"standard input, line {number}: {e}") from None
        session.start(messages[:-1])
        reply = session.ask(messages[-1].content)
        for piece in reply.pieces():
            if not as_json:
                out.write(piece)
        if as_json:
            out.write(
                json.dumps({"answer": reply.text, "finish_reason": reply.finish_reason}, ensure_ascii=False)
            )
        out.write("\n")
        out.flush()


def _text(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinigptError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
