"""What the engine hands back to callers, with vLLM's names and shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# For one position: candidate token id -> Logprob. The sampled (or prompt) token is always present.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its `n` outputs so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    num_prompt_tokens: int = -1  # prompt positions; differs from len(prompt_token_ids) for embeddings (no ids)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt_token_ids)


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request: `data` is a float32 tensor ([H] for embed,
    [T, H] for token_embed, [num_labels] for classify)."""

    request_id: str
    prompt_token_ids: list[int]
    data: Any
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
