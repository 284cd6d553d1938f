"""Reasoning parsers (`--reasoning-parser`): the model's thinking, between `<think>` and
`</think>`, goes to `reasoning_content`; the rest is the answer's `content`.

- `qwen3`: reasoning only when the model closes it with `</think>` (a leading `<think>` is
  dropped); text without `</think>` is all content (thinking was off).
- `deepseek_r1`: the template opens the thinking, so the output starts in it: everything up to
  `</think>` is reasoning, and without `</think>` all of it is.
- `openai_gptoss`: gpt-oss's harmony messages (`<|channel|>analysis<|message|>...<|end|>`, then
  `<|start|>assistant<|channel|>final<|message|>...`): the analysis channel is the reasoning, the
  other channels' messages the content; an output that does not open a channel is all content.
  Its tags are special tokens, so a request under this parser keeps them in the text
  (`skip_special_tokens=False`, `web.chat.run`) for the parser to read and drop.

`reasoning_stream` splits streamed deltas the same way, holding back a possible partial tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from web.chat.parser_names import REASONING_PARSERS

PARSERS = REASONING_PARSERS
OPEN, CLOSE = "<think>", "</think>"
CHANNEL, MESSAGE, FINAL = "<|channel|>", "<|message|>", "<|channel|>final<|message|>"
HARMONY_TAGS = ("<|start|>", CHANNEL, MESSAGE, "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


def reasoning_end(parser: str) -> str:
    """The text after which the answer starts (where a grammar for the answer begins to apply)."""
    return FINAL if parser == "openai_gptoss" else CLOSE


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole output."""
    if parser == "openai_gptoss":
        reasoning, content = split_harmony(text)
        return reasoning or None, content
    if CLOSE in text:
        reasoning, _, content = text.partition(CLOSE)
        return reasoning.removeprefix(OPEN).lstrip("\n") or None, content.lstrip("\n")
    if parser == "deepseek_r1":
        return text.removeprefix(OPEN) or None, ""
    return None, text


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of gpt-oss's output: its channel, its recipient (`functions.NAME` for a tool
    call), and its body so far."""

    channel: str
    recipient: str | None
    body: str


_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>(\w+)")


def harmony_messages(text: str) -> list[HarmonyMessage] | None:
    """The messages of `text`, or None if it is not harmony (does not open with a header: a channel,
    or a recipient the model named before it). A body runs from `<|message|>` to the next tag; one
    still without its end (streaming, or cut off) counts as far as it goes."""
    if not text.startswith(CHANNEL) and not text.lstrip().startswith("to="):
        return None
    messages = []
    for part in text.split("<|start|>"):
        header, found, body = part.partition(MESSAGE)
        if not found:
            continue  # the header is all there is so far
        end = min((i for i in (body.find(tag) for tag in HARMONY_TAGS) if i >= 0), default=len(body))
        channel, recipient = _CHANNEL_NAME.search(header), _RECIPIENT.search(header)
        messages.append(HarmonyMessage(channel.group(1) if channel else "", recipient.group(1) if recipient else None,
                                       body[:end]))
    return messages


def split_harmony(text: str) -> tuple[str, str]:
    """(reasoning, content) of harmony messages: the analysis channel, and the messages to the user
    (a message with a recipient is a tool call: `web.chat.tools`, parser `openai`)."""
    messages = harmony_messages(text)
    if messages is None:
        return "", text
    reasoning = "".join(m.body for m in messages if m.channel == "analysis" and m.recipient is None)
    content = "".join(m.body for m in messages if m.channel != "analysis" and m.recipient is None)
    return reasoning, content


@dataclass
class HarmonyStream:
    """`split_harmony` over streamed text: each feed splits all the text so far, less a possible
    partial tag at its end, and returns what is new in each part (a message's body only ever
    grows at its end, and a later message starts after it, so the parts only ever grow)."""

    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.text += text
        visible = self.text
        if not final:
            if CHANNEL.startswith(visible) or "to=".startswith(visible.lstrip()):
                return "", ""  # too early to tell harmony from plain text
            start = visible.rfind("<")
            if start >= 0 and any(tag.startswith(visible[start:]) for tag in HARMONY_TAGS):
                visible = visible[:start]
        reasoning, content = split_harmony(visible)
        delta = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return delta


def reasoning_stream(parser: str) -> ReasoningStream | HarmonyStream:
    """The streaming splitter for `parser`."""
    return HarmonyStream() if parser == "openai_gptoss" else ReasoningStream(parser)


@dataclass
class ReasoningStream:
    """One choice's streamed text, split into reasoning and content deltas as it arrives."""

    parser: str
    in_reasoning: bool = True  # deepseek_r1 starts inside; qwen3 decides on the first text
    pending: str = ""  # text held back: it may be the start of a tag
    started: bool = False
    skip_newlines: bool = False  # just past a tag: newlines there belong to neither part

    def __post_init__(self) -> None:
        self.in_reasoning = self.parser == "deepseek_r1"

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) for `text`; `final` flushes what was held back."""
        text = self.pending + text
        self.pending = ""
        if not self.started and text:
            if OPEN.startswith(text) and not final:
                self.pending = text
                return "", ""
            self.started = True
            if text.startswith(OPEN):
                self.in_reasoning, text, self.skip_newlines = True, text[len(OPEN):], True
        if self.skip_newlines:
            text = text.lstrip("\n")
            self.skip_newlines = not text
        if not self.in_reasoning:
            return "", text
        before, found, after = text.partition(CLOSE)
        if found:
            self.in_reasoning = False
            self.skip_newlines = True
            content = after.lstrip("\n")
            self.skip_newlines = not content
            return before, content
        keep = held_back(before, CLOSE) if not final else 0
        if keep:
            self.pending, before = before[-keep:], before[:-keep]
        return before, ""


def held_back(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: streamed text holds that much back,
    since it may turn out to be the tag (here `</think>`, a tool-call tag in `web.chat.tools`)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
