"""`EngineCoreRequest`: a request as the client states it to the engine core (plain data, at the
engine's root because the input processor in `engine.render` builds it and the core reads it).

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

from engine.mm_features import ImageFeature
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptEmbeds:
    """Embedding rows given for some positions of a prompt, in place of their token embeddings.

    `rows` (a (rows, hidden) tensor) holds every span's rows in prompt order; span `(offset, count)`
    covers prompt positions `offset ... offset + count - 1`. A completions `prompt_embeds` is one
    span over the whole prompt; a chat `prompt_embeds` content part is one span among template tokens.
    """

    rows: Any
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, rows: Any) -> PromptEmbeds:
        return cls(rows, ((0, int(rows.shape[0])),))

    def to(self, *args: Any) -> PromptEmbeds:
        """On another device or dtype (`torch.Tensor.to`'s arguments)."""
        return PromptEmbeds(self.rows.to(*args), self.spans)

    def overlaps(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """For prompt positions `start ... end - 1`: each overlapping span's (first position, end,
        row of its first position)."""
        found, row = [], 0
        for offset, count in self.spans:
            lo, hi = max(start, offset), min(end, offset + count)
            if lo < hi:
                found.append((lo, hi, row + lo - offset))
            row += count
        return found


# Placeholder sampling parameters: the scheduler reads them, a pooling request never samples. One
# frozen instance for all (building and validating one per request showed in the server profile).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


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
    prompt_embeds: PromptEmbeds | None = None
    mm_features: tuple[ImageFeature, ...] = ()
    pooling_params: PoolingParams | None = None
    token_type_ids: tuple[int, ...] | None = None
    lora_name: str | None = None  # the LoRA adapter to run with (None: the base model)
