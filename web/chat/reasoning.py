"""Reasoning parsers (`--reasoning-parser`): the model's thinking, between `<think>` and
`</think>`, goes to `reasoning_content`; the rest is the answer's `content`.

- `qwen3`: reasoning only when the model closes it with `</think>` (a leading `<think>` is
  dropped); text without `</think>` is all content (thinking was off).
- `deepseek_r1`: the template opens the thinking, so the output starts in it: everything up to
  `</think>` is reasoning, and without `</think>` all of it is.

`ReasoningStream` splits streamed deltas the same way, holding back a possible partial tag.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole output."""
    if CLOSE in text:
        reasoning, _, content = text.partition(CLOSE)
        return reasoning.removeprefix(OPEN).lstrip("\n") or None, content.lstrip("\n")
    if parser == "deepseek_r1":
        return text.removeprefix(OPEN) or None, ""
    return None, text


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
