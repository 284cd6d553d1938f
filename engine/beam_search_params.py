"""What a beam search asks for, and what it answers (vLLM's `BeamSearchParams`,
`BeamSearchSequence`, `BeamSearchOutput`). Plain data; the search is `engine/api/beam_search.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class BeamSearchParams:
    """`beam_width` beams of up to `max_tokens` tokens. A beam's score is its cumulative logprob
    over its length (prompt included, a final EOS not) to the power `length_penalty` (vLLM's
    formula). `early_stopping` (Hugging Face's meaning): True stops once `beam_width` beams have
    ended; False also stops then, but only once no running beam can score better than the worst
    of them; "never" runs until `max_tokens` or no beam is left running. `temperature` is taken
    for vLLM's signature: beams are chosen by the model's logprobs, which it does not change."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        checks = [
            (type(self.beam_width) is int and self.beam_width >= 1, "n", f"beam search needs n (the beam width) "
             f"of at least 1, got {self.beam_width!r}"),
            (type(self.max_tokens) is int and self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens!r}"),
            (isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
             and math.isfinite(self.length_penalty), "length_penalty",
             f"length_penalty must be a finite number, got {self.length_penalty!r}"),
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature",
             f"temperature must be non-negative, got {self.temperature!r}"),
            (self.early_stopping in (True, False, "never"), "early_stopping",
             f'early_stopping must be true, false or "never", got {self.early_stopping!r}'),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's ids and the beam's (vLLM's shape)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS ended it) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)

    def output_token_ids(self, sequence: BeamSearchSequence) -> list[int]:
        """The tokens `sequence` generated (after the prompt)."""
        return sequence.tokens[len(self.prompt_token_ids):]
