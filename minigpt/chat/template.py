"""The chat template: a conversation as token ids, with a control token per role and one ending each turn.

    <|system|>You are terse.<|end|><|user|>Hi<|end|><|assistant|>Hello.<|end|>

Each message is its role's token, its content encoded as plain text (a control token's name typed in a
message stays text: nobody can forge a turn), and <|end|>. A prompt for the model's answer ends with
<|assistant|>; the answer ends when the model emits <|end|>. Training counts the loss only where the
assistant speaks: its content and the <|end|> that closes it. A run whose tokenizer lacks these tokens
gets them as new ids after its vocabulary (and new rows in the model). `jinja()` writes the same template
for Hugging Face's `apply_chat_template`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minigpt.common.strict_json import preview
from minigpt.errors import MinigptError

if TYPE_CHECKING:
    from minigpt.tokenizer.base import Tokenizer

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
END = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END)


@dataclass(frozen=True)
class Message:
    """One turn. `weight` 0 leaves an assistant message out of the loss (OpenAI's fine-tuning format)."""

    role: str
    content: str
    weight: int = 1

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def content_text(value: Any) -> Any:
    """A message's content as its text: OpenAI's list of text parts joined, anything else as it is (for
    the caller to check). A text part must hold its text as a string (OpenAI refuses null or an object
    there too): a ValueError says which part does not."""
    if not (isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value)):
        return value
    for n, part in enumerate(value, 1):
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content part {n} has text {preview(part.get('text'))}, not a string")
    return "".join(part["text"] for part in value)


def has_chat_tokens(tokenizer: Tokenizer) -> bool:
    return all(name in tokenizer.specials for name in CHAT_TOKENS)


def with_chat_tokens(tokenizer: Tokenizer, model_vocab: int) -> Tokenizer:
    """`tokenizer` with the chat template's control tokens, those it lacks numbered after both its own ids
    and the model's `model_vocab` rows (a Hugging Face model may have more rows than tokens)."""
    if has_chat_tokens(tokenizer):
        return tokenizer
    return tokenizer.with_specials(CHAT_TOKENS, max(tokenizer.vocab_size, model_vocab))


class ChatTemplate:
    """Renders conversations for one tokenizer (which must hold the chat tokens) and parses them back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        if not has_chat_tokens(tokenizer):
            raise MinigptError(
                f"this run's tokenizer ({tokenizer.describe()}) has no chat tokens: it was not fine-tuned "
                f"on conversations; train it with `minigpt train --init-from RUN chat.jsonl`"
            )
        self.tokenizer = tokenizer
        specials = tokenizer.specials
        self.role_ids = {role: specials[name] for role, name in ROLE_TOKENS.items()}
        self.end_id = specials[END]
        self._roles_by_id = {i: role for role, i in self.role_ids.items()}

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end an answer: <|end|>, any other control token (a new turn) and <|endoftext|>."""
        return frozenset(self.tokenizer.special_ids())

    def message_ids(self, message: Message) -> list[int]:
        return [self.role_ids[message.role], *self.tokenizer.encode(message.content), self.end_id]

    def render(self, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        """The conversation's ids, and for each id whether training predicts it: the content and closing
        <|end|> of every assistant message of weight 1."""
        ids: list[int] = []
        targets: list[bool] = []
        for message in messages:
            part = self.message_ids(message)
            learn = message.role == "assistant" and message.weight > 0
            ids += part
            targets += [False] + [learn] * (len(part) - 1)
        return ids, targets

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The conversation so far, then <|assistant|>: what the model continues with its answer."""
        return self.render(messages)[0] + [self.role_ids["assistant"]]

    def parse(self, ids: Sequence[int]) -> list[Message]:
        """The messages `render` (or `prompt`) gave these ids for; a prompt's open assistant turn is left out."""
        messages: list[Message] = []
        i = 0
        while i < len(ids):
            role = self._roles_by_id.get(ids[i])
            if role is None:
                raise MinigptError(f"token {i} ({ids[i]}) should start a turn with a role token")
            end = next((j for j in range(i + 1, len(ids)) if ids[j] == self.end_id), None)
            if end is None:
                if role == "assistant" and i == len(ids) - 1:
                    break
                raise MinigptError(f"the {role} turn at token {i} has no {END}")
            messages.append(Message(role, self.tokenizer.decode(ids[i + 1 : end])))
            i = end + 1
        return messages

    @staticmethod
    def text(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as a string with the control tokens spelled out (what `jinja()` renders)."""
        body = "".join(f"{ROLE_TOKENS[m.role]}{m.content}{END}" for m in messages)
        return body + (ROLE_TOKENS["assistant"] if add_generation_prompt else "")

    @staticmethod
    def jinja() -> str:
        """The template in Jinja for Hugging Face's tokenizer_config.json: `apply_chat_template` renders
        `text()`, which a tokenizer that knows the control tokens encodes to `render()`'s ids. Each control
        token is a whole string literal, so transformers' `sanitize_control_tokens=True` finds them and
        keeps a control token's name typed in a message as text, as `render()` does; "developer" (OpenAI's
        newer name for it) is the system role, as in `minigpt serve`."""
        roles = "".join(
            f"{{%- {'if' if i == 0 else 'elif'} {_jinja_is_one_of(names)} -%}}{{{{ '{ROLE_TOKENS[role]}' }}}}"
            for i, (role, names) in enumerate(_JINJA_ROLES.items())
        )
        unknown = "{{ raise_exception('a message role must be system, user or assistant') }}"
        return (
            f"{{%- for message in messages -%}}{roles}{{%- else -%}}{unknown}{{%- endif -%}}"
            f"{{{{ message['content'] }}}}{{{{ '{END}' }}}}{{%- endfor -%}}"
            f"{{%- if add_generation_prompt -%}}{{{{ '{ROLE_TOKENS['assistant']}' }}}}{{%- endif -%}}"
        )


# the message roles the Jinja template takes, by the role whose token they get
_JINJA_ROLES = {"system": ("system", "developer"), "user": ("user",), "assistant": ("assistant",)}


def _jinja_is_one_of(names: Sequence[str]) -> str:
    """A Jinja test that the message's role is one of `names`, written with `==` and `or`: llama.cpp's Jinja
    engine cannot parse a one-element tuple such as `in ('user',)`, and stops its chat mode on it."""
    return " or ".join(f"message['role'] == {name!r}" for name in names)
