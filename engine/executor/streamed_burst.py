"""`StreamedBurst`: a decode burst whose tokens reach the engine core step by step while it runs.

A decode burst (`--num-scheduler-steps`, vLLM v0's multi-step scheduling) runs several decodes
back to back in the worker's thread, so the loop's per-step work (scheduling, the hand-offs to the
thread and back) is paid once per burst. Returned whole, its tokens would also stream in bursts.
In process they need not: after each step the worker thread hands the step's tokens to the event
loop with `TrioToken.run_sync_soon` (a write to trio's wake-up socket; the thread does not wait
for the loop) and goes on to the next step, while a task of the burst's publishes them. The
worker thus runs decodes back to back and the loop publishes token N while the model computes
token N + 1, on the other core.

The consumer says after each step whether the burst may go on (`run`'s `on_step`): the core ends a
burst early when a request finished in it or a message (a new request, an abort) waits, so a
burst never holds up an arrival for more than the step in flight.

Ordering: trio runs `run_sync_soon` callbacks in the order they were queued, and the worker
thread's own completion is delivered the same way, so every step's tokens are in the stream
before `to_thread.run_sync` returns; the stream is closed after that.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial

import anyio
import trio
from anyio.streams.memory import MemoryObjectSendStream

from engine.concurrency.to_the_end import run_to_the_end
from engine.executor.base import PendingStep
from engine.sched.output import ModelRunnerOutput, SchedulerOutput, StepSink

BurstExecute = Callable[[SchedulerOutput, StepSink], ModelRunnerOutput]


class StreamedBurst(PendingStep):
    """A burst started by the in-process executor, run by `run` (not by `result`)."""

    def __init__(self, execute: BurstExecute, sched_out: SchedulerOutput, limiter: anyio.CapacityLimiter) -> None:
        super().__init__()
        self._execute = execute
        self._sched_out = sched_out
        self._limiter = limiter
        self._going = True  # read by the worker thread after each step (a bool: one GIL-atomic load)

    async def run(self, on_step: Callable[[ModelRunnerOutput], bool]) -> ModelRunnerOutput:
        """Run the burst in the worker's thread; `on_step` gets each step's tokens in order, on the
        event loop, while the next step computes, and returns whether the burst may go on (False:
        the worker stops after the step it is in). Returns the burst's output: what failed and
        `steps_run`, no tokens.

        Cancellation stops the burst after the step in flight once it reaches the burst's task (no
        further step starts), waits for the thread to return (the executor's contract), then
        raises; tokens of steps not yet handed to `on_step` are dropped."""
        send, receive = anyio.create_memory_object_stream[ModelRunnerOutput](math.inf)
        token = trio.lowlevel.current_trio_token()

        def post(step: ModelRunnerOutput) -> bool:  # in the worker thread, after each step
            # The verdict on the steps before this one: read before this one is handed over, so that
            # the loop's verdict on a step always lets the next one run, however the threads
            # interleave (read after, it sometimes stopped the burst a step earlier).
            going = self._going
            token.run_sync_soon(_deliver, send, step)
            return going

        async def consume() -> None:
            try:
                async with receive:
                    async for step in receive:
                        if not on_step(step):
                            self._going = False
            except BaseException:
                self._going = False  # cancelled or failed: no more steps
                raise

        async with anyio.create_task_group() as burst:
            burst.start_soon(consume)
            with send:
                output = await run_to_the_end(partial(anyio.to_thread.run_sync, self._execute, self._sched_out,
                                                      post, limiter=self._limiter))
        self._output = output
        return output


def _deliver(send: MemoryObjectSendStream[ModelRunnerOutput], step: ModelRunnerOutput) -> None:
    """On the event loop (a `run_sync_soon` callback, where an exception would end trio's run): a
    consumer that has gone (cancelled) simply misses the step."""
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        send.send_nowait(step)

