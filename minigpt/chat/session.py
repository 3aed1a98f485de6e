"""A conversation with a run: its messages, fitting them into the model's context, and streamed answers.

The model sees the system message (if any), then as many of the latest turns as fit in its context with
room left for the answer; older turns are dropped, and `Reply.dropped` says how many more than before. The
whole conversation stays in `messages` (what `save` writes). Answers come from the one decode loop
(`minigpt.generate.decode.Generation`), ending at the chat template's control tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from minigpt.chat.template import ChatTemplate, Message
from minigpt.errors import MinigptError
from minigpt.generate.config import GenerateConfig
from minigpt.generate.decode import Engine, Generation
from minigpt.tokenizer.base import Tokenizer


class Reply:
    """One answer being generated: iterate `pieces()` for its text as it streams, then `close()` it (also
    after Ctrl-C: what was said so far stays in the conversation)."""

    def __init__(self, session: ChatSession, generation: Generation, dropped: int, cut: int) -> None:
        self.session = session
        self.generation = generation
        self.dropped = dropped  # messages that no longer fit, newly dropped for this answer
        self.cut = cut  # tokens cut from the start of a prompt too long even alone
        self.text = ""

    def pieces(self) -> Iterator[str]:
        for event in self.generation.events():
            self.text += event.text
            if event.text:
                yield event.text

    @property
    def finish_reason(self) -> str | None:
        return self.generation.streams[0].finish_reason

    def close(self) -> None:
        """Keep the answer (so far) as the assistant's turn; an empty one leaves the question unanswered."""
        if self.text.strip():
            self.session.messages.append(Message("assistant", self.text))
        else:
            self.session.messages.pop()


class ChatSession:
    """The messages of one conversation with a model, and its answers."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        settings: GenerateConfig,
        system: str | None = None,
        seed: int = 0,
    ) -> None:
        """`settings`: how answers are drawn, as `minigpt generate` draws text (one sample each); answer n
        uses seed + n, where settings give no seed."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.settings = settings
        self.seed = seed if settings.seed is None else settings.seed
        self.system = [Message("system", system)] if system else []
        self.messages: list[Message] = list(self.system)
        self.first = len(self.system)  # the oldest message the model still sees, after the system's
        self.turns = 0

    @property
    def room(self) -> int:
        """Prompt tokens that leave the answer room: half the context at most goes to the answer."""
        block = self.engine.block_size
        return block - min(self.settings.max_new_tokens, block // 2)

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.start(self.system)

    def start(self, messages: Sequence[Message]) -> None:
        """Go on from these messages (a first system message becomes the session's)."""
        self.system = [m for m in messages[:1] if m.role == "system"]
        self.messages = list(messages)
        self.first = len(self.system)

    def ask(self, text: str) -> Reply:
        """Start the answer to the user's `text`."""
        if not text.strip():
            raise MinigptError("an empty message has nothing to answer")
        self.messages.append(Message("user", text))
        try:
            ids, dropped, cut = self._fit()
        except MinigptError:  # e.g. a character a char model never saw: the question is not asked
            self.messages.pop()
            raise
        options = {**self.settings.generation(0), "seed": self.seed + self.turns, "num_samples": 1}
        generation = Generation(self.engine, self.tokenizer, ids, **options, stop_ids=self.template.stop_ids)
        self.turns += 1
        return Reply(self, generation, dropped, cut)

    def _fit(self) -> tuple[list[int], int, int]:
        """The prompt ids, after dropping the oldest messages that no longer fit (never the last one):
        (ids, how many were newly dropped, tokens cut from the front of a last message too long alone)."""
        start = self.first
        head = self.messages[: len(self.system)]
        while True:
            ids = self.template.prompt([*head, *self.messages[start:]])
            if len(ids) <= self.room or start == len(self.messages) - 1:
                break
            start += 1
        if len(ids) > self.room and head:  # the system message too, as a last resort
            ids = self.template.prompt(self.messages[start:])
        dropped, self.first = start - self.first, start
        cut = max(0, len(ids) - self.room)
        return ids[cut:], dropped, cut

    def save(self, path: Path) -> None:
        """Write the conversation as one JSONL record ({"messages": [...]}, the training format), appended to
        an existing .jsonl file; any other existing file is left alone."""
        line = json.dumps({"messages": [m.to_json() for m in self.messages]}, ensure_ascii=False) + "\n"
        if path.exists() and (path.suffix != ".jsonl" or not path.is_file()):
            raise MinigptError(f"{path} exists and is not a .jsonl file: choose another name")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:
            raise MinigptError(f"cannot write {path} ({e.strerror})") from None


def conversation_of(record: str, system: str | None) -> list[Message]:
    """One piped input: a JSON record in the training format (answered after its last message, the user's),
    or a line of text (one user message); `system` is the system message where the record has none."""
    from minigpt.chat.data import BadRecord, parse_record

    stripped = record.strip()
    messages = [Message("user", stripped)]
    if stripped.startswith("{"):
        try:
            messages = parse_record(stripped.encode("utf-8"), training=False)
        except BadRecord as e:
            raise MinigptError(str(e)) from None
        if messages[-1].role != "user":
            raise MinigptError("the last message must be the user's: it is the one answered")
    if system and messages[0].role != "system":
        messages.insert(0, Message("system", system))
    return messages
