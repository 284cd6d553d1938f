"""Small helpers shared by the engine tests."""

from engine import SamplingParams
from engine.outputs import RequestOutput


async def final_output(engine, prompt, params: SamplingParams | None = None, **kwargs) -> RequestOutput:
    last = None
    async for last in engine.generate(prompt, params, **kwargs):
        pass
    assert last is not None and last.finished
    return last


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
