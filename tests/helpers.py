"""Small helpers shared by the engine tests."""

import subprocess

from bench.together import tokens_together
from engine import SamplingParams, open_engine
from engine.outputs import RequestOutput


async def final_output(engine, prompt, params: SamplingParams | None = None, **kwargs) -> RequestOutput:
    outputs = [output async for output in engine.generate(prompt, params, **kwargs)]
    assert outputs and outputs[-1].finished
    return outputs[-1]


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


async def greedy_together(config, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens (EOS ignored) of every prompt, run together on one engine of `config`."""
    async with open_engine(config) as engine:
        return await tokens_together(engine, prompts, greedy(max_tokens, ignore_eos=True))


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body; asserts the framing is exact."""
    assert body.endswith(b"\n\n"), body[-50:]
    events = body.decode().split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: "):] for event in events]


def log_until(process: subprocess.Popen[str], marker: str) -> list[str]:
    """The lines a server process logs up to the first holding `marker` (it is listening); read
    from its stderr as they come, no polling and no sleeps. RuntimeError if it exits first."""
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if marker in line:
            return seen
    raise RuntimeError("the server exited during start-up:\n" + "".join(seen[-30:]))
