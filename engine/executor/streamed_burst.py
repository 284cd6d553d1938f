"""`StreamedBurst`: a decode burst whose tokens reach the engine core step by step while it runs.

A decode burst (`--num-scheduler-steps`, vLLM v0's multi-step scheduling) runs several decodes
back to back in the worker's thread, so the loop's per-step work (scheduling, the hand-offs to the
thread and back) is paid once per burst. Returned whole, its tokens would also stream in bursts.
In process they need not: after each step the worker thread hands the step's tokens to the event
loop with `TrioToken.run_sync_soon` (a write to trio's wake-up socket; the thread does not wait
for the loop) and goes on to the next step, while the loop publishes them from that callback. The
worker thus runs decodes back to back and the loop publishes token N as soon as it gets to run
(in the served layout it shares the compute CPU, so between the worker's steps).

The consumer says after each step whether the burst may go on (`run`'s `on_step`): the core ends a
burst early when a request finished in it or a message (a new request, an abort) waits, so a
burst never holds up an arrival for more than the step in flight.

Ordering: trio runs `run_sync_soon` callbacks in the order they were queued, and the worker
thread's own completion is delivered the same way; a step either queues a callback or joins one
already queued (`_Handover.queue`: a loop that lags takes the steps waiting with one wake-up), so
every step's tokens have been handed to `on_step`, in order, before `to_thread.run_sync` returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import anyio
import trio

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
        `steps_run`, no tokens. An exception from `on_step` stops the burst the same way and is
        raised here once the thread has returned.

        Cancellation stops the burst after the step in flight once it reaches the burst's task (no
        further step starts), waits for the thread to return (the executor's contract), then
        raises; tokens of steps not yet handed to `on_step` are dropped."""
        token = trio.lowlevel.current_trio_token()
        handed = _Handover(on_step, self._stop)

        def post(step: ModelRunnerOutput) -> bool:  # in the worker thread, after each step
            # The verdict on the steps before this one: read before this one is handed over, so that
            # the loop's verdict on a step always lets the next one run, however the threads
            # interleave (read after, it sometimes stopped the burst a step earlier).
            going = self._going
            if handed.queue(step):
                token.run_sync_soon(handed.take_queued)
            return going

        async with anyio.create_task_group() as burst:
            burst.start_soon(self._stop_when_cancelled, handed)
            output = await run_to_the_end(partial(anyio.to_thread.run_sync, self._execute, self._sched_out,
                                                  post, limiter=self._limiter))
            burst.cancel_scope.cancel()  # the thread has returned: the watcher's job is done
        if handed.failure is not None:
            raise handed.failure
        self._output = output
        return output

    async def _stop_when_cancelled(self, handed: _Handover) -> None:
        """Sleeps beside the thread; a cancellation of the burst's task reaches it here (the thread's
        wait is shielded) and stops the burst after the step in flight."""
        try:
            await anyio.sleep_forever()
        finally:
            self._stop()
            handed.open = False

    def _stop(self) -> None:
        """No step after the one in flight (the worker reads `_going` after each step)."""
        self._going = False


class _Handover:
    """Each step's tokens to `on_step`, called straight from a `run_sync_soon` callback on the
    event loop (no task of its own: one wake-up a token, not a wake-up and a task switch). Steps
    the thread hands over while a callback is already queued join it (`queue`): a loop that lags
    behind the steps takes them with one wake-up. trio ends its run if such a callback raises, so
    an exception is kept for the burst's task, and the steps after it, or after a cancellation,
    are dropped."""

    __slots__ = ("_on_step", "_queued", "_stop_burst", "_waking", "failure", "open")

    def __init__(self, on_step: Callable[[ModelRunnerOutput], bool], stop_burst: Callable[[], None]) -> None:
        self._on_step = on_step
        self._stop_burst = stop_burst
        self._queued: deque[ModelRunnerOutput] = deque()
        self._waking = False  # a `take_queued` callback is queued and has not started
        self.failure: BaseException | None = None
        self.open = True

    def queue(self, step: ModelRunnerOutput) -> bool:
        """In the worker thread: `step` joins the queue; True when the caller must queue a
        `take_queued` callback (none is queued). Under the GIL, and `take_queued` clears the flag
        before it takes: a step queued after that finds the flag clear and queues another."""
        self._queued.append(step)
        if self._waking:
            return False
        self._waking = True
        return True

    def take_queued(self) -> None:
        """On the event loop: every step queued so far, in order."""
        self._waking = False
        while self._queued:
            self.take(self._queued.popleft())

    def take(self, step: ModelRunnerOutput) -> None:
        if not self.open:
            return
        try:
            if not self._on_step(step):
                self._stop_burst()  # after the step in flight, whose tokens still come
        except BaseException as exc:  # noqa: BLE001 -- raised in the burst's task (`StreamedBurst.run`)
            self.failure = exc
            self.open = False
            self._stop_burst()
