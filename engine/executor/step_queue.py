"""`StepQueue`: steps started without waiting, run in order in the worker's thread, each output
handed back behind the device event of its step.

Async scheduling (engine/sched/scheduler.py) keeps two steps in flight, so starting a step must
not wait for it. Each step goes into one memory object stream; one task, the queue's, takes them
in order and runs each in the worker thread (`to_thread.run_sync` under the worker's limiter of
one: two tasks racing for the limiter could run step N+1 first). The step's future is a one-item
memory object stream of its own, read once by `PendingStep.result`.

On a device the worker's thread returns once the step's work is queued (`Worker.start_model`): its
sampled tokens are still being copied to pinned host memory on a side stream (`output.pending`,
engine/worker/transfers.py). So a `DeviceEvent` is recorded on that stream and sent with the output,
and the engine core waits for it on the event loop (`DeviceEvent.wait`: a CUDA event synchronised on in a
thread, never on the loop) before reading the tokens (`output.resolve()`), while the queue's task
already starts the next step. On CPU the event is complete when recorded; tests drive a
`FakeDeviceBackend`, whose events complete when they say.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.concurrency.device_event import CPU_BACKEND, CudaBackend, DeviceBackend, DeviceEvent
from engine.executor.base import PendingStep
from engine.sched.output import ModelRunnerOutput, SchedulerOutput

Reply = tuple[DeviceEvent, ModelRunnerOutput] | BaseException
_Job = tuple[SchedulerOutput, MemoryObjectSendStream[Reply]]


def device_backend_for(device: str) -> DeviceBackend:
    """CUDA events on a CUDA device; elsewhere work is done when it is recorded."""
    return CudaBackend() if device.startswith("cuda") else CPU_BACKEND


class StepQueue:
    """Steps run in order in a worker thread; see the module doc. Use as an async context
    manager: entering starts the queue's task, leaving lets it finish the steps already started
    (it is not interrupted: a step's half-done state is nobody's to use) and stops it."""

    def __init__(self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], limiter: anyio.CapacityLimiter,
                 backend: DeviceBackend) -> None:
        self._execute = execute
        self._limiter = limiter
        self._backend = backend
        self._stack = contextlib.AsyncExitStack()
        self._jobs: MemoryObjectSendStream[_Job] | None = None

    async def __aenter__(self) -> StepQueue:
        """Start the queue's task. Cancellation: nothing is left running."""
        task_group: TaskGroup = await self._stack.enter_async_context(anyio.create_task_group())
        send, receive = anyio.create_memory_object_stream[_Job](math.inf)
        self._jobs = send
        task_group.start_soon(self._run, receive)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Closing the job stream ends the task once the steps already sent have run. Cancellation
        (or leaving with an error) drops the steps not yet started (their results raise); the
        step in the worker thread still runs to its end first."""
        if self._jobs is not None:
            self._jobs.close()
            self._jobs = None
        return await self._stack.__aexit__(*exc_info)

    def start(self, sched_out: SchedulerOutput) -> PendingStep:
        """Queue the step; never waits. Its output comes from the returned `PendingStep`."""
        assert self._jobs is not None, "the queue is not running"
        send, receive = anyio.create_memory_object_stream[Reply](1)
        self._jobs.send_nowait((sched_out, send))
        return PendingStep(wait=lambda: _output(receive))

    async def _run(self, jobs: MemoryObjectReceiveStream[_Job]) -> None:
        async with jobs:
            async for sched_out, reply in jobs:
                with reply:
                    try:
                        output = await anyio.to_thread.run_sync(self._execute, sched_out, limiter=self._limiter)
                    except Exception as exc:  # the step's failure is its caller's to raise
                        reply.send_nowait(exc)
                        continue
                    done = DeviceEvent(self._backend)
                    done.record(output.pending.stream if output.pending is not None else None)
                    reply.send_nowait((done, output))


async def _output(receive: MemoryObjectReceiveStream[Reply]) -> ModelRunnerOutput:
    """A step's output once its device work is done; its error if it failed."""
    with receive:
        try:
            reply = await receive.receive()
        except anyio.EndOfStream:
            raise RuntimeError("the step was dropped: the executor stopped before running it") from None
    if isinstance(reply, BaseException):
        raise reply
    done, output = reply
    await done.wait()
    output.resolve()  # the copy is done: reads the pinned host memory, no waiting
    return output
