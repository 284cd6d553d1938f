"""Helpers for testing code that uses the engine, under trio's `MockClock`.

`FakeExecutor` stands in for the model: each step costs `step_time` virtual
seconds and produces tokens from a deterministic function, so application
code (timeouts, retries, streaming) can be tested against the real engine
core, scheduler and output path in milliseconds of wall time:

    clock = trio.testing.MockClock(autojump_threshold=0)
    async with open_engine(config, executor=FakeExecutor(step_time=0.05)) as engine:
        ...  # one step = 50 virtual ms
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import anyio

from engine.concurrency.to_the_end import run_to_the_end
from engine.executor.base import Executor
from engine.model_info import ModelInfo
from engine.sched.output import ModelRunnerOutput, SchedulerOutput

TokenFn = Callable[[str, int], int]  # (request id, position of the new token) -> token id


def _default_token(request_id: str, position: int) -> int:
    return 100 + position % 100


class FakeExecutor(Executor):
    def __init__(self, step_time: float = 0.01, token_fn: TokenFn = _default_token, vocab_size: int = 512,
                 max_position_embeddings: int = 512, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.step_time = step_time
        self.token_fn = token_fn
        self.info = ModelInfo(vocab_size=vocab_size, hidden_size=8, max_position_embeddings=max_position_embeddings,
                              eos_token_ids=eos_token_ids, dtype="float32", kv_bytes_per_block=1024)
        self.steps: list[SchedulerOutput] = []

    async def load_model(self) -> ModelInfo:
        return self.info

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: `step_time` virtual seconds, then the tokens of `token_fn`. Cancellation waits
        for the step to end (it is recorded), then raises, as every executor's does.
        """
        return await run_to_the_end(partial(self._step, sched_out))

    async def _step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        await anyio.sleep(self.step_time)
        self.steps.append(sched_out)
        return ModelRunnerOutput(sampled_token_ids={
            s.request_id: self.token_fn(s.request_id, s.start_position + s.num_tokens)
            for s in sched_out.scheduled if s.sample})
