"""Conversation data: JSONL records checked line by line, rendered by the chat template, and batched so
that the loss counts only the assistant's tokens.

Two record shapes, one per line: OpenAI's chat format, `{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}` (an assistant message may carry `"weight": 0` to be left out of the
loss), and `{"prompt": "...", "completion": "..."}` (one user turn and its answer). A bad record (not JSON,
a missing or unknown role, empty content, nothing for the assistant to learn, longer than the context) is
a one-line error naming its file and line, or, with `skip_bad_records`, skipped and counted.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from minigpt.chat.template import ROLES, ChatTemplate, Message, content_text, with_chat_tokens
from minigpt.common.files import open_regular, regular_file
from minigpt.common.strict_json import JsonError, parse_json, preview
from minigpt.corpus.inputs import stamp_source
from minigpt.data.dataset import BatchSampler, DataConfig, _input_record, eval_rows
from minigpt.errors import MinigptError, UsageError
from minigpt.tokenizer.base import Tokenizer
from minigpt.tokenizer.load import build_tokenizer, tokenizer_kind

if TYPE_CHECKING:
    import torch

SUFFIX = ".jsonl"
MAX_RECORD_BYTES = 16 << 20  # one conversation per line; a longer line is damage, not a conversation
MAX_MESSAGES = 10_000
PAD_MULTIPLE = 16  # batch widths: a multiple of this, and of an eighth of their power of two (`padded_width`)
_FIX = "fix the record or pass --skip-bad-records to skip bad ones"
R = TypeVar("R")


class BadRecord(MinigptError):
    """A record that cannot be trained on; `reason` groups skipped records in the summary."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------- files


def conversation_files(paths: Sequence[Path]) -> list[Path] | None:
    """The JSONL conversation files among `paths` (folders give their .jsonl files), or None when the
    paths are text; a mix of text and conversations is a UsageError."""
    files: list[Path] = []
    for p in map(Path, paths):
        try:
            files += sorted(f for f in p.rglob(f"*{SUFFIX}") if f.is_file()) if p.is_dir() else [p]
        except OSError as e:  # e.g. a name too long for the filesystem
            raise MinigptError(f"cannot access {p}: {e.strerror}") from None
    chat = [regular_file(f) for f in files if f.suffix == SUFFIX and _first_record_is_chat(regular_file(f))]
    if not chat:
        return None
    if len(chat) != len(files):
        other = next(f for f in files if f not in chat)
        raise UsageError(
            f"{other} is not conversation JSONL but {chat[0]} is: train on text or on conversations, not both"
        )
    return chat


def _first_record_is_chat(path: Path) -> bool:
    """Whether a .jsonl file's first record is a conversation (the reader names any problem later)."""
    if path.suffix != SUFFIX:
        return False
    try:
        for _, line in _lines(path):
            record = parse_json(line)
            return isinstance(record, dict) and ("messages" in record or "prompt" in record)
    except (MinigptError, JsonError):
        pass
    return True


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a file, each line bounded in size, blank lines left out."""
    with open_regular(path) as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), 1):
            if len(line) > MAX_RECORD_BYTES:
                raise MinigptError(
                    f"{path}:{number}: the line is longer than {MAX_RECORD_BYTES >> 20} MB: one conversation "
                    f"per line, please"
                )
            if line.strip():
                yield number, line


def parse_record(line: bytes, training: bool = True) -> list[Message]:
    """The messages of one JSONL line, or a BadRecord saying what is wrong with it. `training`: the record
    must hold an answer to learn from (otherwise it is a conversation to answer, with or without one)."""
    record = json_record(line)
    if "messages" in record:
        return _messages(record["messages"], training)
    if "prompt" in record or "completion" in record:
        prompt = Message("user", _content(record.get("prompt"), "prompt"))
        if not training and "completion" not in record:
            return [prompt]
        return [prompt, Message("assistant", _content(record.get("completion"), "completion"))]
    raise BadRecord("no conversation", 'has neither "messages" nor "prompt" and "completion"')


def json_record(line: bytes) -> dict[str, Any]:
    """The JSON object on one line, or a BadRecord."""
    try:
        record = parse_json(line.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise BadRecord("not UTF-8", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except JsonError as e:
        raise BadRecord("not JSON", f"not a JSON record ({str(e)[:80]})") from None
    if not isinstance(record, dict):
        raise BadRecord("not JSON", "not a JSON object")
    return record


def _content(value: Any, what: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined."""
    try:
        value = content_text(value)
    except ValueError as e:
        raise BadRecord("bad content", f"{what}: {e}") from None
    if value is None:
        raise BadRecord("missing content", f"{what} has no content")
    if not isinstance(value, str):
        raise BadRecord("bad content", f"{what} has content that is not text")
    if not value.strip():
        raise BadRecord("empty content", f"{what} has empty content")
    return value


def _messages(value: Any, training: bool) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise BadRecord("no messages", '"messages" is not a non-empty list')
    if len(value) > MAX_MESSAGES:
        raise BadRecord("too many messages", f"has more than {MAX_MESSAGES:,} messages")
    messages = []
    for n, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise BadRecord("bad message", f"message {n} is not an object")
        role = m.get("role")
        if role is None:
            raise BadRecord("missing role", f"message {n} has no role")
        if role not in ROLES:
            raise BadRecord(
                "unknown role", f"message {n} has role {str(role)[:20]!r}: use {', '.join(ROLES)}"
            )
        if role == "system" and n > 1:
            raise BadRecord("system not first", f"message {n} is a system message: only the first may be")
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool) or role != "assistant" and "weight" in m:
            raise BadRecord(
                "bad weight", f"message {n} has weight {preview(weight)}: assistant messages take 0 or 1"
            )
        messages.append(Message(role, _content(m.get("content"), f"message {n} ({role})"), weight))
    if training and not any(m.role == "assistant" and m.weight for m in messages):
        raise BadRecord("no assistant", "has no assistant message to learn from")
    return messages


@dataclass
class Skipped:
    """Records left out with skip_bad_records: counts by reason, and the first one's location and why."""

    counts: Counter[str] = field(default_factory=Counter)
    first: str | None = None

    def add(self, where: str, error: BadRecord) -> None:
        self.counts[error.reason] += 1
        self.first = self.first or f"{where}: {error}"

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())
        return f"skipped {self.total:,} bad record(s) ({reasons}); the first: {self.first}"


def read_conversations(
    path: Path, template: ChatTemplate, block_size: int, skipped: Skipped | None
) -> Iterator[tuple[list[int], list[bool]]]:
    """Each good record of a JSONL file rendered: (ids, targets), at most block_size + 1 ids. A bad record
    is a MinigptError naming file and line, or, with `skipped`, counted there and left out."""
    return read_records(path, lambda line: render(template, parse_record(line), block_size), skipped)


def read_records(path: Path, parse: Callable[[bytes], R], skipped: Skipped | None) -> Iterator[R]:
    """Each good line of a JSONL file as `parse` reads it (a BadRecord for a bad one), with the errors and
    skipping of read_conversations."""
    for number, line in _lines(path):
        where = f"{path}:{number}"
        try:
            yield parse(line)
        except BadRecord as e:
            if skipped is None:
                raise MinigptError(f"{where}: {e}; {_FIX}") from None
            skipped.add(where, e)


def render(template: ChatTemplate, messages: list[Message], block_size: int) -> tuple[list[int], list[bool]]:
    """The messages' (ids, targets), or a BadRecord for characters the tokenizer lacks or a context overrun."""
    try:
        ids, targets = template.render(messages)
    except MinigptError as e:  # a char tokenizer meeting a character it never saw
        raise BadRecord("unknown characters", str(e).split("; ")[0]) from None
    if len(ids) > block_size + 1:
        raise BadRecord(
            "longer than the context",
            f"the conversation is {len(ids):,} tokens, more than the model's context of {block_size:,} "
            f"(+1): shorten it",
        )
    return ids, targets


# ---------------------------------------------------------------------------------------------- splits


def padded_width(longest: int, widest: int) -> int:
    """A batch's width for conversations of up to `longest` inputs: rounded up to a multiple of PAD_MULTIPLE
    and of an eighth of its power of two (at most 1/8 more from 128 on), never past `widest`.

    Padded to the longest alone, nearly every batch of variable-length conversations has a width of its
    own, and on the CPU in bfloat16 oneDNN builds and keeps kernels for each new shape, so a run's memory
    grows with every width it meets; a few widths bound it at no cost in speed (bench/bench_finetune.py).
    The padded tokens predict nothing."""
    step = max(PAD_MULTIPLE, 1 << max(longest.bit_length() - 4, 0))
    return min(-(-longest // step) * step, widest)


class ConversationSplit:
    """Rendered conversations, flat: ids, which ids are predicted, and where each conversation starts.

    len() is the number of predicted tokens, what the loss averages over (and bits per byte divide by).
    """

    def __init__(self, ids: np.ndarray, targets: np.ndarray, starts: np.ndarray) -> None:
        self.ids, self.targets, self.starts = ids, targets, starts  # starts: n + 1 offsets

    @classmethod
    def of(cls, conversations: Sequence[tuple[list[int], list[bool]]]) -> ConversationSplit:
        lengths = [len(ids) for ids, _ in conversations]
        starts = np.zeros(len(conversations) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        ids = np.fromiter((i for c, _ in conversations for i in c), dtype=np.uint32, count=int(starts[-1]))
        targets = np.fromiter((t for _, c in conversations for t in c), dtype=bool, count=int(starts[-1]))
        return cls(ids, targets, starts)

    def __len__(self) -> int:
        return int(self.targets.sum())  # a conversation's first token (a role) is never a target

    @property
    def conversations(self) -> int:
        return len(self.starts) - 1

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @functools.cached_property
    def widest(self) -> int:
        """The longest conversation's inputs (all its tokens but the last)."""
        return int(np.diff(self.starts).max(initial=1)) - 1

    def batch(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of these conversations, padded to the longest's `padded_width`: y is -1 wherever nothing
        is predicted."""
        import torch

        spans = [(int(self.starts[r]), int(self.starts[r + 1])) for r in rows]
        width = padded_width(max(b - a for a, b in spans) - 1, self.widest)
        x = np.zeros((len(rows), width), dtype=np.int64)
        y = np.full((len(rows), width), -1, dtype=np.int64)
        for row, (a, b) in enumerate(spans):
            n = b - a - 1
            x[row, :n] = self.ids[a : b - 1]
            y[row, :n] = np.where(self.targets[a + 1 : b], self.ids[a + 1 : b].astype(np.int64), -1)
        return torch.from_numpy(x), torch.from_numpy(y)

    def eval_batches(
        self,
        batch_size: int,
        max_batches: int | None,
        rank: int = 0,
        world_size: int = 1,
        chunk: int | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed batches for evaluation: every conversation, or an evenly spaced max_batches x batch_size of
        them (per rank), shared out between ranks; `chunk` per batch (default batch_size)."""
        mine = eval_rows(self.conversations, batch_size, max_batches, rank, world_size)
        step = chunk or batch_size
        for i in range(0, len(mine), step):
            yield self.batch(mine[i : i + step])


class ConversationSampler(BatchSampler):
    """batch_size random conversations a batch, drawn as BatchSampler draws windows (reseeded from seed,
    rank and batch number, so its state is the number of batches drawn), padded to the longest."""

    tokens: ConversationSplit  # type: ignore[assignment]

    def _check_enough(self, tokens: Any, block_size: int) -> None:
        if tokens.conversations < 1:
            raise MinigptError("there are no training conversations")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        self._gen.manual_seed(self._batch_seed(self.batches))
        self.batches += 1
        rows = torch.randint(0, self.tokens.conversations, (self.batch_size,), generator=self._gen)
        return self.tokens.batch(rows.tolist())


# ---------------------------------------------------------------------------------------------- dataset


@dataclass
class ConversationData:
    """Training and validation conversations, as the trainer takes a Dataset."""

    tokenizer: Tokenizer
    train: ConversationSplit
    val: ConversationSplit
    val_bytes: int  # UTF-8 bytes of the predicted validation tokens
    train_bytes: int
    inputs: tuple[dict[str, Any], ...] = ()
    skipped: Skipped = field(default_factory=Skipped)

    sampler_class: ClassVar[type[BatchSampler]] = ConversationSampler  # what draws its training batches
    # conversations are tokenized before training starts: nothing runs beside it (the Dataset interface)
    complete = True
    tokenized_at_start = True

    def status(self) -> str | None:
        return None

    def close(self) -> None:
        pass

    @property
    def summary(self) -> str:
        return (
            f"{self.train.conversations:,} train / {self.val.conversations:,} val conversations "
            f"({len(self.train):,} / {len(self.val):,} assistant tokens)"
        )


def predicted_bytes(split: ConversationSplit, lengths: np.ndarray) -> int:
    return int(lengths[split.ids[split.targets]].sum())


def read_splits(
    config: DataConfig,
    files: Sequence[Path],
    read: Callable[[Path, Skipped | None], Iterable[R]],
    what: str,
    note: Callable[[str], None],
) -> tuple[list[R], list[R], tuple[dict[str, Any], ...], Skipped]:
    """The good records `read` gives of the files and of config.val_file (else the last val_fraction of
    them validate), the input files' records and what was skipped: `what` the records are, for errors."""
    val_files = conversation_files([config.val_file]) if config.val_file is not None else []
    if config.val_file is not None and not val_files:
        raise UsageError(f"--val-file {config.val_file} is not conversation JSONL, unlike the training data")
    sources = [stamp_source(f, "utf-8") for f in [*files, *(val_files or [])]]
    skipped = Skipped() if config.skip_bad_records else None
    train = [c for f in files for c in read(f, skipped)]
    if val_files:
        val = [c for f in val_files for c in read(f, skipped)]
    else:
        n_val = max(1, round(len(train) * config.val_fraction))
        train, val = train[:-n_val], train[-n_val:]
    if skipped is not None and skipped.total:
        note(skipped.describe())
    if not train or not val:
        raise MinigptError(
            f"{files[0]}: {len(train) + len(val)} good {what}(s): too few for a training and a "
            f"validation split (each needs one); give more, or a --val-file"
        )
    inputs = tuple(_input_record(s, "val" if i >= len(files) else "train") for i, s in enumerate(sources))
    return train, val, inputs, skipped or Skipped()


def prepare_conversations(
    config: DataConfig,
    files: Sequence[Path],
    block_size: int,
    tokenizer: Tokenizer | None = None,
    note: Callable[[str], None] = lambda message: None,
) -> ConversationData:
    """Read, check and render the conversation files (and config.val_file, if given) with the chat template:
    `tokenizer` (a fine-tuned run's base, given the chat tokens it lacks) or one learned from the messages."""
    if tokenizer is None:
        tokenizer = _learn_tokenizer(config, files)
    tokenizer = with_chat_tokens(tokenizer, tokenizer.vocab_size)
    template = ChatTemplate(tokenizer)

    def read(path: Path, skipped: Skipped | None) -> Iterator[tuple[list[int], list[bool]]]:
        return read_conversations(path, template, block_size, skipped)

    train, val, inputs, skipped = read_splits(config, files, read, "conversation", note)
    lengths = tokenizer.text_byte_lengths()
    train_split, val_split = ConversationSplit.of(train), ConversationSplit.of(val)
    data = ConversationData(
        tokenizer, train_split, val_split, predicted_bytes(val_split, lengths),
        predicted_bytes(train_split, lengths), inputs, skipped,
    )  # fmt: skip
    note(f"conversations: {data.summary}")
    return data


def _learn_tokenizer(config: DataConfig, files: Sequence[Path]) -> Tokenizer:
    """A new run's char or bpe tokenizer, learned from the messages' text (a tiktoken name just loads)."""
    kind = tokenizer_kind(config.tokenizer)

    def texts() -> Iterator[str]:
        for path in files:
            for _, line in _lines(path):
                try:
                    yield "\n".join(m.content for m in parse_record(line))
                except BadRecord:
                    continue

    return build_tokenizer(config.tokenizer, texts if kind != "tiktoken" else None, config.vocab_size)
