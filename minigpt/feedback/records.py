"""Preference pairs and tasks: the JSONL records DPO and RL read, checked line by line as conversations are.

A file's kind is read from its first record's keys: "chosen" and "rejected" make preference pairs, an
"answer" (with no "completion") makes tasks, anything else is conversations (minigpt.chat.data). A run
given a reward (`--reward`) reads its files as tasks whatever their keys, since a regular expression or a
function may need no reference answer.

- Preference pair: `{"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}` or
  `{"messages": [prefix], "chosen": ..., "rejected": ...}` (the shapes TRL's DPOTrainer reads, its explicit
  prompt). A string prompt is one user message; a string answer is one assistant message; messages are
  OpenAI's chat format. Only the answers' assistant messages are scored (their content and <|end|>).
- Task: `{"prompt": str | messages, "answer": str}` or `{"messages": [prefix], "answer": str}`; the answer
  (text, or an integer) is what the exact-match reward compares with, and the whole record is what a
  `module:function` reward is given.

A bad record is a one-line error naming its file and line, or, with skip_bad_records, skipped and counted,
exactly as for conversations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from minigpt.chat.data import BadRecord, _content, _lines, _messages, json_record, render
from minigpt.chat.template import ChatTemplate, Message
from minigpt.common.strict_json import JsonError, parse_json
from minigpt.errors import UsageError
from minigpt.feedback.kinds import CONVERSATIONS, PREFERENCES, TASKS


def kind_of(record: Any, reward: bool = False) -> str:
    """What a parsed record is: preference pairs, tasks (or anything, given a reward), or conversations."""
    if isinstance(record, dict) and "chosen" in record and "rejected" in record:
        return PREFERENCES
    if reward or isinstance(record, dict) and "answer" in record and "completion" not in record:
        return TASKS
    return CONVERSATIONS


def files_kind(files: list[Path], reward: bool = False) -> str:
    """The kind of every one of the JSONL files (read from each one's first record); a mix is a UsageError."""
    kinds = {f: _first_kind(f, reward) for f in files}
    found = sorted(set(kinds.values()))
    if len(found) > 1:
        a, b = (next(f for f, k in kinds.items() if k == kind) for kind in found[:2])
        raise UsageError(f"{a} holds {found[0]} but {b} holds {found[1]}: give files of one kind")
    return found[0] if found else CONVERSATIONS


def _first_kind(path: Path, reward: bool) -> str:
    """The kind of the file's first record that reads as JSON: a bad one before it is the reader's to name
    (or skip), and must not turn a file of pairs or tasks into conversations."""
    for _, line in _lines(path):
        try:
            return kind_of(parse_json(line.decode("utf-8-sig")), reward)
        except (JsonError, UnicodeDecodeError):
            continue
    return TASKS if reward else CONVERSATIONS


# ---------------------------------------------------------------------------------------------- records


def _prefix(record: dict[str, Any]) -> list[Message]:
    """The conversation a pair's answers or a task's answer continue (its prompt or messages), none of it
    scored."""
    if "messages" in record:
        messages = _messages(record["messages"], training=False)
    elif "prompt" in record:
        value = record["prompt"]
        if isinstance(value, list) and any(isinstance(m, dict) and "role" in m for m in value):
            messages = _messages(value, training=False)
        else:
            messages = [Message("user", _content(value, "prompt"))]
    else:
        raise BadRecord("no prompt", 'has neither "prompt" nor "messages"')
    if messages[-1].role == "assistant":
        raise BadRecord(
            "ends with an answer", "its prompt ends with an assistant message: end it before the answer"
        )
    return [replace(m, weight=0) for m in messages]


def _answer(value: Any, what: str) -> list[Message]:
    """An answer: a string (one assistant message), or messages that start with the assistant's."""
    if isinstance(value, list):
        messages = _messages(value, training=True)
        if messages[0].role != "assistant":
            raise BadRecord(
                "bad answer", f"{what} starts with a {messages[0].role} message, not the assistant's"
            )
        return messages
    return [Message("assistant", _content(value, what))]


@dataclass(frozen=True)
class Pair:
    """One preference pair rendered: (ids, targets) of prefix + chosen and of prefix + rejected, the targets
    the answers' assistant messages only."""

    chosen: tuple[list[int], list[bool]]
    rejected: tuple[list[int], list[bool]]


def parse_pair(line: bytes, template: ChatTemplate, block_size: int) -> Pair:
    """One JSONL line as a preference pair of at most block_size + 1 ids a side, or a BadRecord."""
    record = json_record(line)
    for key in ("chosen", "rejected"):
        if key not in record:
            raise BadRecord("no pair", f'has no "{key}" answer')
    prefix = _prefix(record)
    chosen, rejected = (
        render(template, prefix + _answer(record[k], k), block_size) for k in ("chosen", "rejected")
    )
    if chosen[0] == rejected[0]:
        raise BadRecord("same answers", "its chosen and rejected answers are the same")
    return Pair(chosen, rejected)


@dataclass(frozen=True)
class Task:
    """One task rendered: the prompt's ids (ending with <|assistant|>), its reference answer if it has one,
    and the record as read (what a `module:function` reward is given)."""

    prompt: list[int]
    answer: str | None
    record: dict[str, Any]


def parse_task(
    line: bytes, template: ChatTemplate, block_size: int, answer_tokens: int, need_answer: bool
) -> Task:
    """One JSONL line as a task whose prompt leaves `answer_tokens` of the model's context for the answer,
    or a BadRecord (one without an answer, when `need_answer`)."""
    record = json_record(line)
    answer = record.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is not None and not isinstance(answer, str):
        raise BadRecord("bad answer", "its answer is not text")
    if need_answer and answer is None:
        raise BadRecord("no answer", 'has no "answer" to compare with: add one, or name another --reward')
    ids, _ = render(template, _prefix(record), block_size)
    if len(ids) + 1 + answer_tokens > block_size + 1:
        raise BadRecord(
            "longer than the context",
            f"the prompt is {len(ids) + 1:,} tokens, leaving less than the {answer_tokens:,} answer tokens "
            f"(--answer-tokens) of the model's context of {block_size:,}: shorten it",
        )
    return Task([*ids, template.role_ids["assistant"]], answer, record)
