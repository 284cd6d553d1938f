"""Several prompts run at once on an open engine: each one's final token ids, in prompt order."""

from __future__ import annotations

from functools import partial

from engine.api.async_engine import AsyncEngine
from engine.concurrency.gather import gather_first_failure
from engine.sampling_params import SamplingParams


async def final_tokens(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The token ids of the request's last output (cumulative or final-only outputs)."""
    tokens: list[int] = []
    async for output in engine.generate(prompt, params):
        tokens = list(output.outputs[0].token_ids)
    return tokens


async def tokens_together(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt submitted at once (batched by the scheduler); the first failure cancels the rest."""
    return await gather_first_failure([partial(final_tokens, engine, prompt, params) for prompt in prompts])
