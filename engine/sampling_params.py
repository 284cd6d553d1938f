"""Per-request sampling parameters, validated when constructed.

Names and defaults follow vLLM's `SamplingParams` so code written against
vLLM reads the same here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError
from engine.structured_outputs import StructuredOutputs

_GREEDY_EPSILON = 1e-5

# Hard bounds that hold whatever the model; the engine adds the model's own (vocabulary size,
# context length, max_num_seqs, max_logprobs) when a request is submitted. docs/limits.md lists all.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKENS_LIMIT = 1 << 31  # max_tokens/min_tokens beyond any context window (the engine checks the real one)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    # vLLM's: the logprobs of these token ids (besides the chosen token's) at every generated position,
    # instead of the top N. Scoring a fixed set of labels needs no top-k over the vocabulary.
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (compiled by the engine).
    structured_outputs: StructuredOutputs | None = None
    # Added to the logits of these token ids before sampling ((token id, bias) pairs; a dict is taken too)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these
    bad_words: tuple[str, ...] = ()  # words never generated (as token sequences: `bad_words_token_ids`)
    truncate_prompt_tokens: int | None = None  # keep only N of the prompt's tokens
    truncation_side: str = "left"  # which end truncate_prompt_tokens cuts: left keeps the last N (vLLM's)
    # Filled in by the engine from `bad_words`: each word's token ids, with and without a leading space.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # Filled in by the engine: the model's EOS ids (generation_config + tokenizer).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(bias.items()) if isinstance(bias, dict) else tuple(bias or ()))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logprob_token_ids is not None:
            object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        self._validate_types()
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k < MAX_TOKENS_LIMIT, "top_k",
             f"top_k must be -1 (disable) or at least 1 (at most the vocabulary size), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.max_tokens is None or 1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens",
             f"max_tokens must be at least 1 (and fit the model's context), got {self.max_tokens}"),
            (0 <= self.min_tokens <= MAX_TOKENS_LIMIT, "min_tokens",
             f"min_tokens must be non-negative (and fit the model's context), got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs < MAX_TOKENS_LIMIT, "logprobs",
             f"logprobs must be non-negative (at most the server's max_logprobs), got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs < MAX_TOKENS_LIMIT, "prompt_logprobs",
             f"prompt_logprobs must be non-negative (at most the server's max_logprobs), got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop",
             f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"),
            (all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
             f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters"),
            (all(0 <= t < MAX_TOKENS_LIMIT for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be token ids of the vocabulary"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}"),
            (self.seed is None or self.seed >= SEED_MIN and self.seed + self.n - 1 <= SEED_MAX, "seed",
             f"seed must be in [-2**63, 2**64 - n] (here n={self.n}): every sample's seed must fit 64 bits, "
             f"got {self.seed}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        self._validate_token_lists()

    def _validate_token_lists(self) -> None:
        for token, bias in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}",
                                          param="logit_bias")
        if len(self.logit_bias) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"logit_bias may hold at most {MAX_STOP_TOKEN_IDS} entries", param="logit_bias")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words) or len(self.bad_words) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"bad_words must be at most {MAX_STOP_STRINGS} non-empty strings",
                                      param="bad_words")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not _is_int(keep) or keep < 1):
            raise InvalidRequestError(f"truncate_prompt_tokens must be at least 1, got {keep!r}",
                                      param="truncate_prompt_tokens")
        if self.truncation_side not in ("left", "right"):
            raise InvalidRequestError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}",
                                      param="truncation_side")
        allowed = self.allowed_token_ids
        if allowed is not None and (not allowed or not all(_is_int(t) and t >= 0 for t in allowed)):
            raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids",
                                      param="allowed_token_ids")
        named = self.logprob_token_ids
        if named is not None and (not named or not all(_is_int(t) and t >= 0 for t in named)):
            raise InvalidRequestError("logprob_token_ids must be a non-empty list of token ids",
                                      param="logprob_token_ids")

    def _validate_types(self) -> None:
        """Numbers of the right type, finite: a NaN compares false to everything and would pass."""
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be integers", param="stop_token_ids")
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)

    @property
    def wants_logprobs(self) -> bool:
        """Whether each generated token's logprobs are returned (top N, or the named ids')."""
        return self.logprobs is not None or self.logprob_token_ids is not None

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
