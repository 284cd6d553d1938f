"""Per-request sampling parameters, validated when constructed.

Names and defaults follow vLLM's `SamplingParams` so code written against
vLLM reads the same here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError

_GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0  # everything generated so far (vLLM's default for the library API)
    DELTA = 1  # only what is new since the previous output (what SSE streaming wants)
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Invalid values raise `InvalidRequestError` naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine: the model's EOS ids (generation_config + tokenizer).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be non-negative, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_child(self, index: int) -> SamplingParams:
        """The params of the `index`-th of `n` parallel samples: n=1, and a distinct seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    def with_eos(self, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        return replace(self, eos_token_ids=tuple(eos_token_ids))
