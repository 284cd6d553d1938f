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
from typing import Any

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
        """One step: `step_time` virtual seconds (for each of a burst's steps), then the tokens of
        `token_fn`. Cancellation waits for the step to end (it is recorded), then raises, as every
        executor's does.
        """
        return await run_to_the_end(partial(self._step, sched_out))

    async def _step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        await anyio.sleep(self.step_time * sched_out.num_steps)  # a decode burst: each of its steps
        self.steps.append(sched_out)
        return ModelRunnerOutput(sampled_token_ids={
            s.request_id: [self.token_fn(s.request_id, s.start_position + s.num_tokens + i)
                           for i in range(sched_out.num_steps)]
            for s in sched_out.scheduled if s.sample})


# ---- white-box probes of a worker, for `Executor.collective_rpc(probe)` ------------------------
# Functions of the worker, not methods of it: what only tests ask stays out of the Worker class,
# and a worker process finds them by name (they pickle as `engine.testing.<name>`).

def wait_for_writer(worker: Any, fifo: str) -> None:
    """Block this worker until something opens the FIFO at `fifo` for writing and closes it: a test
    holds the worker's next calls (which run in order) behind this one until it lets them go."""
    with open(fifo, "rb") as reader:
        reader.read()


def encoder_runs(worker: Any) -> int:
    """Images this rank ran through the vision encoder since the KV cache was set up."""
    return int(getattr(worker.runner, "num_encoded", 0))


def expert_placement(worker: Any) -> list[list[int]]:
    """Each MoE layer's physical slot -> logical expert map, as routing uses it now."""
    return [experts.phy2log.tolist() for experts in worker.model.moe_layers]


def model_summary(worker: Any) -> dict[str, Any]:
    """What this rank holds: its rank and its share of the model."""
    model = worker.model
    return {"rank": worker.rank, "world_size": worker.tp.size, "local_kv_heads": model.num_local_kv_heads,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "stage": worker.stage.rank, "layers": [model.layer_range.start, model.layer_range.stop]}
