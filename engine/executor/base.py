"""The executor interface the engine core drives.

An executor owns the worker(s). `execute_model` is awaited once per step by
the engine-core task only, so calls never overlap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from engine.concurrency.to_the_end import run_to_the_end
from engine.eplb.plan import LayerPlan
from engine.model_info import ModelInfo
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker_messages import RPCMethod

# Expert moves staged per call to worker processes: one expert's weights delays the next step by
# a copy (and a send between ranks), a whole layer's by all of them (measured: `trio-llm bench eplb`).
STAGE_MOVES_PER_CALL = 1


class PendingStep:
    """A step started by `Executor.start_model`: its output, once, from `result()`."""

    def __init__(self, output: ModelRunnerOutput | None = None,
                 wait: Callable[[], Awaitable[ModelRunnerOutput]] | None = None) -> None:
        self._output = output
        self._wait = wait

    async def result(self) -> ModelRunnerOutput:
        """The step's output. Cancellation waits for the step to end (the executor's contract:
        the workers must stay consistent), then raises."""
        if self._output is None:
            assert self._wait is not None
            self._output = await run_to_the_end(self._wait)
        return self._output


class Executor(ABC):
    """Used as an async context manager by `open_engine`: entering starts whatever the
    executor runs (worker processes and their tasks), leaving stops it."""

    async def __aenter__(self) -> Executor:
        """Start what the executor runs. Cancellation during start-up stops whatever had started,
        then propagates.
        """
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Stop the workers: `aclose()` in a shielded scope limited to 10 seconds, so a cancelled
        caller still releases them.
        """
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await self.aclose()
        return None

    async def collective_rpc(self, method: RPCMethod, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None, *,
                             timeout: float | None = None,  # noqa: ASYNC109 -- vLLM's collective_rpc signature
                             non_block: bool = False,
                             unique_reply_rank: int | None = None) -> Any:
        """Call a Worker method (by name) or a function of the worker on every worker; see
        `engine.executor.rpc.WorkerGroup`.

        Cancellation abandons the call: its replies are read and dropped, never handed to a later
        call.
        """
        raise NotImplementedError(f"{type(self).__name__} has no workers to call")

    @abstractmethod
    async def load_model(self) -> ModelInfo:
        """Load the model on every worker; returns what the engine needs to size itself.

        Cancellation stops waiting; the executor is then unusable and must be closed.
        """

    @abstractmethod
    async def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker.

        Cancellation stops waiting; the executor is then unusable and must be closed.
        """

    @abstractmethod
    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Cancellation waits for the step in flight to end (the worker's
        state must stay consistent), then raises: implementations await the step through
        `engine.concurrency.to_the_end.run_to_the_end` (tests/test_executor_contract.py checks each)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may keep in flight at once (vLLM's name): one, or one per pipeline
        stage, so that every stage has a step to run."""
        return 1

    @property
    def streams_bursts(self) -> bool:
        """Whether a decode burst's tokens reach the core step by step as they are sampled (in
        process: `StreamedBurst`) rather than with the burst's last step; where they do, bursts are
        the default on CPU (`EngineConfig.scheduler_steps`)."""
        return False

    async def start_model(self, sched_out: SchedulerOutput) -> PendingStep:
        """Start one step and return it without waiting for its output (`PendingStep.result`).
        Executors that run one step at a time run it to the end here.

        Cancellation: as `execute_model`."""
        return PendingStep(await self.execute_model(sched_out))

    async def eplb_stage_layer(self, plan: LayerPlan) -> None:
        """Stage one MoE layer's expert moves on every worker (`Worker.eplb_stage_layer`), ready for a
        step to commit. Worker processes run calls between steps, in call order on every rank, so
        the layer goes in parts of `STAGE_MOVES_PER_CALL` moves: no step waits behind a whole layer.

        Cancellation abandons the call (as `collective_rpc`); a staged layer nobody commits is
        replaced by the next staging of that layer."""
        for first in range(0, max(1, len(plan.moves)), STAGE_MOVES_PER_CALL):
            await self.collective_rpc("eplb_stage_layer", (plan, first, STAGE_MOVES_PER_CALL))

    async def wait_for_failure(self) -> BaseException:
        """Wait until the executor fails on its own (a worker process dies), busy or idle; the
        error to stop the engine with. In-process executors never do: this waits until cancelled.

        Cancellation just stops the wait."""
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    def workers_alive(self) -> tuple[bool, ...]:
        """Whether each worker (rank order) is alive. In-process executors have one, alive
        as long as the executor is open."""
        return (True,)

    def worker_pids(self) -> tuple[int, ...]:
        """The worker processes' pids in rank order (on their own nodes, under Ray); none when the
        worker is a thread of this process."""
        return ()

    async def aclose(self) -> None:  # noqa: B027 -- optional: an executor with nothing to release keeps it
        """Release workers. Safe to call more than once.

        Callers shield it from cancellation (as `__aexit__` does): it must run to the end to leave no
        worker behind.
        """
