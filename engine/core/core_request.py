"""`EngineCoreRequest`: a request as the client states it to the engine core.

The server process (or `AsyncEngine` in process) renders, checks and resolves a request, then hands
the core this frozen value, in process or pickled over the engine process's socket. The core builds
the scheduler's mutable `Request`s from it (one per sample), and they never leave the core: their
status, block hashes and worker bookkeeping are the scheduler's own, as in vLLM, where
`EngineCoreRequest` crosses to the core and `Request` lives there.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from engine.multimodal import ImageFeature
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sched.request import Request

POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)  # a pooling request's prefill samples nothing


@dataclass(frozen=True)
class EngineCoreRequest:
    """One request, resolved: `sampling_params` carry the model's EOS ids and the bad words' ids,
    `max_tokens` is what the context leaves when the caller set none. A pooling request has
    `pooling_params` and runs its prompt only."""

    request_id: str
    prompt: str | None  # the text, when the caller gave one (outputs repeat it)
    prompt_token_ids: tuple[int, ...]  # placeholders only, for a prompt of embeddings
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    cache_key: Hashable | None = None  # prefix-cache namespace (embeddings, cache salt, images)
    prompt_embeds: Any = None  # a (rows, hidden) tensor, or None
    mm_features: tuple[ImageFeature, ...] = ()
    pooling_params: PoolingParams | None = None
    token_type_ids: tuple[int, ...] | None = None

    def scheduler_requests(self) -> list[Request]:
        """The scheduler's requests: one, or with `n` samples the children "id-0", "id-1", ... with
        distinct seeds. Built inside the core, which alone mutates them."""
        params = self.sampling_params
        if self.pooling_params is not None or params.n == 1:
            children = [(self.request_id, params)]
        else:
            children = [(f"{self.request_id}-{i}", params.for_child(i)) for i in range(params.n)]
        return [Request(child_id, list(self.prompt_token_ids), child_params, arrival_time=self.arrival_time,
                        priority=self.priority, max_tokens=self.max_tokens, cache_key=self.cache_key,
                        prompt_embeds=self.prompt_embeds, mm_features=list(self.mm_features),
                        pooling_params=self.pooling_params,
                        token_type_ids=None if self.token_type_ids is None else list(self.token_type_ids))
                for child_id, child_params in children]
