"""How `minigpt chat` opens each conversation (each field an option of the command); plain data, so the CLI
builds its options without importing the chat session and its tokenizers."""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.common.settings import setting


@dataclass(frozen=True)
class ChatConfig:
    """The system message each conversation opens with."""

    system: str | None = setting(None, "A system message that opens the conversation.")
