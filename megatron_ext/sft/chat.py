"""Conversations to tokens and the assistant mask, through the tokenizer's chat template.

A data file is JSON lines, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line. As in
Megatron-LM's SFT dataset, a line may hold several conversations: a new one starts at each ``system``
message after the first message.

The loss covers the assistant tokens, found by rendering prefixes of the conversation, so a template
without generation tags works: for the assistant message i,

    before = render(messages[:i], add_generation_prompt=True)
    upto   = render(messages[:i + 1])

the text ``upto[len(before):]`` is assistant text: the reply and whatever the template closes the turn
with (``<|im_end|>``, EOS). The conversation is tokenized once, as ``apply_chat_template`` tokenizes
it (the whole render, no special tokens added), and a token is an assistant token when any of its
characters lies in assistant text (character offsets of a fast tokenizer). A template that renders an
earlier turn differently once later turns follow (Qwen3 keeps ``<think>`` only after the last user
turn) has no such prefixes and is refused by name, as is every other conversation that cannot be
trained on as given (see ``DataError``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

ROLES = ("system", "user", "assistant")  # always accepted; another role must be one the template renders


class DataError(ValueError):
    """A line of a data file that cannot be trained on: its number and why (one line)."""

    def __init__(self, line: int, why: str):
        super().__init__(f"line {line}: {why}")
        self.line = line


@dataclass(frozen=True)
class Encoded:
    """One conversation: its token ids and which of them are assistant tokens (in the loss)."""

    ids: np.ndarray  # int64 [n]
    assistant: np.ndarray  # bool [n]


def read_lines(path: str) -> list[tuple[int, list[dict]]]:
    """(line number, messages) for every non-blank line of a JSON-lines file."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(number, f"not JSON ({e.msg} at column {e.colno})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise DataError(number, 'expected {"messages": [{"role": ..., "content": ...}, ...]}, a non-empty list')
            for k, message in enumerate(messages, 1):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                    raise DataError(number, f"message {k} is not {{\"role\": <text>, \"content\": ...}}")
            lines.append((number, messages))
    return lines


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """Megatron-LM's rule (megatron/training/datasets/sft_dataset.py:81): a system message starts a
    new conversation."""
    conversations: list[list[dict]] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


class ChatTemplate:
    """A Hugging Face (fast) tokenizer and the chat template conversations are rendered with.

    ``assistant_prefix_tokens``: the leading tokens of each assistant turn left out of the loss, as
    megatron's SFTTokenizer prompt formats declare them (``PromptConfig.assistant_prefix_len``: the
    "<SPECIAL_11>Assistant\\n" header of nemotron-nano-v2, whose template has no generation prompt)."""

    def __init__(self, hf_tokenizer, template: str, assistant_prefix_tokens: int = 0):
        self.hf = hf_tokenizer
        self.template = template
        self.assistant_prefix_tokens = assistant_prefix_tokens

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                           chat_template=self.template)

    def _render_prefix(self, messages: list[dict], generation_prompt: bool = False) -> str:
        # a template may read messages[0] unconditionally: the empty conversation renders as nothing
        if not messages and not generation_prompt:
            return ""
        return self.render(messages, generation_prompt)

    def encode(self, messages: list[dict], line: int) -> Encoded:
        """The conversation's tokens and assistant mask; DataError (naming `line`) where it cannot be
        trained on."""
        from jinja2 import TemplateError

        try:
            return self._encode(messages, line)
        except (TemplateError, TypeError) as e:  # the template's raise_exception, or what it cannot render
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(line, f"the chat template refuses it: {why}") from None

    def _encode(self, messages: list[dict], line: int) -> Encoded:
        for k, message in enumerate(messages):
            if message["role"] not in ROLES and \
                    self._render_prefix(messages[: k + 1]) == self._render_prefix(messages[:k]):
                raise DataError(line, f"unknown role {message['role']!r} (message {k + 1}): the chat template "
                                f"renders nothing for it; roles are {', '.join(ROLES)} and those the template renders")
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise DataError(line, "a conversation with no assistant turn: nothing to learn")
        text = self.render(messages)
        spans = []
        for k in turns:
            before = self._render_prefix(messages[:k], generation_prompt=True)
            upto = self.render(messages[: k + 1])
            if not upto.startswith(before):
                raise DataError(line, f"assistant turn at message {k + 1}: the chat template's render up to it does not "
                                "begin with the render before it and the generation prompt")
            if not text.startswith(upto):
                raise DataError(line, f"assistant turn at message {k + 1}: the chat template renders it differently once "
                                "later turns follow (not prefix-stable); give each such reply its own conversation, "
                                "or a prefix-stable --chat-template")
            spans.append((len(before), len(upto)))
        encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        assistant = np.zeros(len(ids), dtype=bool)
        offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        for start, end in spans:
            inside = np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))
            assistant[inside[self.assistant_prefix_tokens:]] = True
        predicted = assistant[1:]  # the first token is never predicted
        if not predicted.any():
            raise DataError(line, "the assistant mask covers no token: the template's render of the assistant turns "
                            "adds nothing to learn")
        if predicted.all():
            raise DataError(line, "the assistant mask covers every token: the template renders no prompt to leave "
                            "out of the loss")
        return Encoded(ids, assistant)
