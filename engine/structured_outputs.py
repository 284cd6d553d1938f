"""Structured outputs as a request asks for them: plain data (vLLM's `StructuredOutputsParams`).

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of
strings), `grammar` (EBNF/GBNF or Lark) or `json_object` (any JSON object). The engine compiles
it with llguidance (`engine.render.grammar`) and keeps the compiled grammar in `compiled`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False  # JSON with free whitespace between tokens (off: compact JSON only)
    compiled: str | None = None  # filled by the engine: the llguidance grammar
    # With a reasoning model: the token ids that end its reasoning (`</think>`). The grammar applies
    # from the token after them, or from the start if the prompt holds them already (thinking off).
    reasoning_end: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                                      f"{', '.join(given) or 'none'}", param="structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured outputs choice must be a non-empty list of strings",
                                      param="structured_outputs")

    def starts_active(self, prompt_token_ids: list[int]) -> bool:
        """Whether the grammar applies from the first generated token."""
        return not self.reasoning_end or _contains(prompt_token_ids, self.reasoning_end)

    @property
    def key(self) -> str:
        """What identifies the grammar (the compile cache's key)."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return f"{kind}:{self.whitespace_flexible}:{text}"


def _contains(tokens: list[int], run: tuple[int, ...]) -> bool:
    width = len(run)
    return any(tuple(tokens[i:i + width]) == run for i in range(len(tokens) - width + 1))
