"""The scheduler's view of one request: its tokens, progress and status."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from engine.mm_features import ImageFeature
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence to generate. Owned by the scheduler; nothing else mutates it.

    `cache_key` namespaces prefix caching: prompts whose KV depends on more
    than their token ids (prompt embeddings, a cache salt) set it so they never
    match plain token prompts.

    `prompt_embeds`, when set, is an opaque (to the scheduler) tensor of one
    row per prompt position; `prompt_token_ids` are then placeholders that only
    give the prompt its length.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_key: Hashable | None = None
    max_tokens: int = 16  # resolved by the engine (SamplingParams.max_tokens or the remaining context)
    prompt_embeds: Any = None
    pooling_params: Any = None  # set: a prefill-only pooling request (no sampling, done after its prompt)
    token_type_ids: list[int] | None = None
    mm_features: list[ImageFeature] = field(default_factory=list)  # images, in prompt order
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first schedule; -1 until then
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    known_to_worker: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)


def check_stop(request: Request, max_model_len: int) -> bool:
    """After a token was appended: set a finished status if a token-level stop condition holds.

    Stop strings are checked by the detokenizer (they need text); this handles
    EOS, `stop_token_ids`, `max_tokens`, `min_tokens` and the context length.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in params.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
