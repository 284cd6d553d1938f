"""The in-process executor: the Worker runs in a worker thread, one call at a time.

`anyio.to_thread.run_sync` with a limiter of one: the forward pass leaves the
event loop (torch releases the GIL inside its kernels), so the loop keeps
accepting requests, streaming outputs and answering health checks while the
model computes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio

from engine.concurrency.device_event import DeviceBackend
from engine.concurrency.to_the_end import run_to_the_end
from engine.config import EngineConfig
from engine.eplb.plan import LayerPlan
from engine.executor.base import Executor, PendingStep
from engine.executor.step_queue import StepQueue, device_backend_for
from engine.executor.streamed_burst import StreamedBurst
from engine.model_info import ModelInfo
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker
from engine.worker.worker_messages import RPCMethod


class InProcExecutor(Executor):
    def __init__(self, config: EngineConfig, worker: Worker | None = None,
                 device_backend: DeviceBackend | None = None) -> None:
        """`device_backend`: how a step's device work is awaited under async scheduling (default:
        the device's own; tests pass a `FakeDeviceBackend`)."""
        self.worker = worker or Worker(config)
        self._limiter = anyio.CapacityLimiter(1)
        self._async_scheduling = config.schedules_async
        self._device_backend = device_backend or device_backend_for(config.device)
        self._steps: StepQueue | None = None  # with async scheduling, while the executor is open
        # Expert staging runs next to the forward pass: it only reads live weights and writes its own buffer.
        self._staging_limiter = anyio.CapacityLimiter(1)
        self._info: ModelInfo | None = None

    async def __aenter__(self) -> InProcExecutor:
        """With async scheduling, start the step queue (steps started without waiting).
        Cancellation: nothing is started yet that needs stopping."""
        if self._async_scheduling:
            self._steps = await StepQueue(self.worker.start_model, self._limiter, self._device_backend).__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """The step queue stops (the step running in the thread ends first; steps not yet started
        are dropped if the caller was cancelled), then the worker is released."""
        if self._steps is not None:
            steps, self._steps = self._steps, None
            await steps.__aexit__(*exc_info)
        return await super().__aexit__(*exc_info)

    @property
    def max_concurrent_batches(self) -> int:
        """Two with async scheduling: the next step is scheduled while one runs."""
        return 2 if self._async_scheduling else 1

    @property
    def streams_bursts(self) -> bool:
        """A burst's tokens are handed to the loop as each step samples them (`StreamedBurst`)."""
        return not self._async_scheduling

    async def start_model(self, sched_out: SchedulerOutput) -> PendingStep:
        """With async scheduling, queue the step and return at once; a decode burst is returned
        unstarted, for the core to run as it streams (`StreamedBurst`); else run the step to the
        end. Cancellation: a queued step runs anyway (its `PendingStep.result` waits for it); else
        as `execute_model`."""
        if self._steps is not None:
            return self._steps.start(sched_out)
        if sched_out.num_steps > 1:  # a decode burst: its tokens stream step by step (`StreamedBurst.run`)
            return StreamedBurst(self.worker.execute_model, sched_out, self._limiter)
        return await super().start_model(sched_out)

    async def load_model(self) -> ModelInfo:
        if self._info is None:  # an LLM facade reuses a loaded worker across engine runs
            self._info = await anyio.to_thread.run_sync(self.worker.load_model, limiter=self._limiter)
        return self._info

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        await anyio.to_thread.run_sync(self.worker.initialize_kv_cache, num_blocks, limiter=self._limiter)

    async def collective_rpc(self, method: RPCMethod, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None, *,
                             timeout: float | None = None,  # noqa: ASYNC109 -- vLLM's collective_rpc signature
                             non_block: bool = False,
                             unique_reply_rank: int | None = None) -> Any:
        """The one in-process worker runs `method` in a thread: a list of one result (or the
        result itself with `unique_reply_rank=0`). `non_block` is not supported here.

        Cancellation takes effect when the worker thread returns (the call is not interrupted).
        """
        if non_block:
            raise NotImplementedError("non_block calls need the multi-process executor")
        if unique_reply_rank not in (None, 0):
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is not a rank of this executor")
        target = partial(method, self.worker) if callable(method) else getattr(self.worker, method)
        call = partial(target, *args, **(kwargs or {}))
        with anyio.fail_after(timeout):
            value = await anyio.to_thread.run_sync(call, limiter=self._limiter)
        return value if unique_reply_rank == 0 else [value]

    async def eplb_stage_layer(self, plan: LayerPlan) -> None:
        """In a thread of its own, concurrently with the step in flight (which a staged layer never
        touches until a later step commits it). Cancellation takes effect when the thread returns."""
        await anyio.to_thread.run_sync(self.worker.eplb_stage_layer, plan, limiter=self._staging_limiter)

    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """The step in a worker thread. Cancellation waits for the thread to return, then raises."""
        return await run_to_the_end(
            partial(anyio.to_thread.run_sync, self.worker.execute_model, sched_out, limiter=self._limiter))
