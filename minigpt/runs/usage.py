"""How to try a run: a short prompt its tokenizer can encode, and the `minigpt generate` command that uses
it, quoted for a POSIX shell (the line after training, the model card's "Use")."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.errors import MinigptError
from minigpt.tokenizer.base import ENDOFTEXT

if TYPE_CHECKING:
    from minigpt.tokenizer.base import Tokenizer

FALLBACK_PROMPT = "Once upon a time"
PROMPT_CHARS = 24  # about four words: enough to steer the continuation, short enough to retype


def opening(text: str) -> str:
    """The start of `text`'s first document's first line with words in it, cut at a space near
    PROMPT_CHARS; leading dashes go, or the shell command would read the prompt as an option."""
    first = text.split(ENDOFTEXT, 1)[0]
    line = next((s for s in (raw.lstrip("- \t") for raw in first.splitlines()) if s.strip()), "").rstrip()
    if len(line) <= PROMPT_CHARS:
        return line
    cut = line.rfind(" ", 0, PROMPT_CHARS + 1)
    return line[:cut].rstrip() if cut > 0 else line[:PROMPT_CHARS]


def _encodes(tokenizer: Tokenizer, prompt: str) -> bool:
    """Whether `prompt` is text the tokenizer encodes ("\\ufffd": a character cut by decoding a prefix)."""
    if not prompt or "\ufffd" in prompt:
        return False
    try:
        return bool(tokenizer.encode(prompt))
    except MinigptError:  # a char tokenizer that never saw one of its characters
        return False


def example_prompt(tokenizer: Tokenizer, text: str = "") -> str:
    """A prompt the tokenizer encodes: the opening of `text` (the run's training text), else
    FALLBACK_PROMPT, else the first token of the vocabulary that is a printable word."""
    for prompt in (opening(text), FALLBACK_PROMPT):
        if _encodes(tokenizer, prompt):
            return prompt
    return next((w for w in _token_texts(tokenizer) if w.isalnum() and _encodes(tokenizer, w)), "")


def _token_texts(tokenizer: Tokenizer) -> Iterator[str]:
    """Each id's text, stripped, in id order (ids that stand for no text left out)."""
    for i in range(tokenizer.vocab_size):
        try:
            yield tokenizer.decode([i]).strip()
        except MinigptError:  # an unused id
            continue


def generate_command(run: Path, prompt: str) -> str:
    """`minigpt generate --model RUN PROMPT` as a shell line; `run` as the user named it, so the line works
    from the folder the run was made in."""
    return shlex.join(["minigpt", "generate", "--model", str(run), *([prompt] if prompt else [])])
