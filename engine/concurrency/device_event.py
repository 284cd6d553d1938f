"""`DeviceEvent`: a device (CUDA) event that a trio task can wait for without blocking the loop.

vLLM's asynchronous EPLB handed weights from a transfer thread to the step loop with CUDA
events, and waiting on a CUDA event that was never recorded returns at once: the consumer
went ahead before the producer had even started. Its fix paired each CUDA event with a
`threading.Event`. Here the pair is a device event and an `anyio.Event`:

- `record(stream)` records the device event on `stream`, then sets the anyio event;
- `await wait(stream)` waits for the anyio event first, so a wait can never pass an event that
  was not recorded; then for the device work, without blocking the loop (with a `stream`, the
  stream is made to wait on the device and the call returns at once); then re-arms with a
  fresh anyio event for the next cycle;
- a second `record` before the matching `wait` raises: a producer that got ahead of its
  consumer is a bug, not a race to lose silently;
- `stop()` ends a waiter cleanly (its `wait` returns False), for shutdown.

One producer and one consumer per event. The device part is a backend: `CPU_BACKEND` (work is
complete when it is recorded), `FakeDeviceBackend` (complete only when a test says so) and
`CudaBackend` (`torch.cuda.Event`, synchronised on in a thread, never on the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread


class DeviceBackend(Protocol):
    def record(self, stream: Any) -> Any:
        """Enqueue an event after the work queued so far on `stream`; returns its handle."""

    def is_done(self, handle: Any) -> bool:
        """Whether the device work before the event has finished (never blocks)."""

    async def wait(self, handle: Any, stream: Any) -> None:
        """Until the work before the event is done; or, given a `stream`, order that stream after
        it on the device and return. Never blocks the loop. Cancellation stops the wait only."""


class CpuBackend:
    """On CPU the work is done by the time it is recorded: the same code path, nothing to wait for."""

    def record(self, stream: Any) -> Any:
        return None

    def is_done(self, handle: Any) -> bool:
        return True

    async def wait(self, handle: Any, stream: Any) -> None:
        """Returns at once (a checkpoint: cancellation is delivered here)."""
        await anyio.lowlevel.checkpoint()


CPU_BACKEND = CpuBackend()


@dataclass
class FakeWork:
    done: anyio.Event = field(default_factory=anyio.Event)
    stream: Any = None


class FakeDeviceBackend:
    """For tests: recorded work completes only when the test calls `complete()`, so "recorded, but
    the device is not done yet" can be exercised without a GPU."""

    def __init__(self) -> None:
        self.pending: list[FakeWork] = []
        self.recorded = 0  # pieces of work recorded in all
        self._new_record: anyio.Event | None = None

    def record(self, stream: Any) -> FakeWork:
        work = FakeWork(stream=stream)
        self.pending.append(work)
        self.recorded += 1
        if self._new_record is not None:
            self._new_record.set()
        return work

    async def wait_until_recorded(self, count: int) -> None:
        """Until `count` pieces of work have been recorded in all. Cancellation stops the wait."""
        while self.recorded < count:
            self._new_record = anyio.Event()
            await self._new_record.wait()

    def is_done(self, handle: FakeWork) -> bool:
        return handle.done.is_set()

    async def wait(self, handle: FakeWork, stream: Any) -> None:
        """Until the test completes the work. Cancellation stops the wait only."""
        await handle.done.wait()

    def complete(self, count: int | None = None) -> int:
        """Finish the oldest `count` pieces of recorded work (all by default); returns how many."""
        finishing = self.pending if count is None else self.pending[:count]
        self.pending = self.pending[len(finishing):]
        for work in finishing:
            work.done.set()
        return len(finishing)


class CudaBackend:
    """`torch.cuda.Event`s. A wait with a stream is a device-side `stream.wait_event`; a wait
    without one hands `event.synchronize()` (which releases the GIL) to a thread of this backend's
    own, so the loop never blocks and is woken the moment the device finishes.

    Not a poll from the loop: trio's timed sleeps wake on epoll's whole milliseconds (a 50 us
    `sleep` takes ~1.2 ms here), so polling `query()` with back-off put a millisecond or more on
    any step not done at the first look; the likeliest part of the H200 run's 2.78 ms a token at
    one stream against a 0.30 ms floor (docs/benchmarks.md)."""

    def __init__(self) -> None:
        # One step's output is awaited at a time; a limiter of its own keeps these waits from
        # queueing behind tokenizer or file work in anyio's default thread pool.
        self._waiters = anyio.CapacityLimiter(1)

    def record(self, stream: Any) -> Any:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        event.record(stream)
        return event

    def is_done(self, handle: Any) -> bool:
        return bool(handle.query())

    async def wait(self, handle: Any, stream: Any) -> None:
        """Device-side ordering with a stream; otherwise until the device work is done, waited
        for in a thread. Cancellation takes effect once that work is done (a step's work is
        bounded, and the thread is never abandoned)."""
        if stream is not None:
            stream.wait_event(handle)
            await anyio.lowlevel.checkpoint()
            return
        if handle.query():
            await anyio.lowlevel.checkpoint()
            return
        await anyio.to_thread.run_sync(handle.synchronize, limiter=self._waiters)


class DeviceEvent:
    """A device event paired with an anyio event (see the module docstring)."""

    def __init__(self, backend: DeviceBackend = CPU_BACKEND) -> None:
        self._backend = backend
        self._recorded = anyio.Event()
        self._handle: Any = None
        self._stopped = False

    def record(self, stream: Any = None) -> None:
        """Record the device event on `stream` and wake the waiter. Raises `RuntimeError` if the
        last recording has not been waited for yet, or after `stop()`."""
        if self._stopped:
            raise RuntimeError("DeviceEvent was stopped")
        if self._recorded.is_set():
            raise RuntimeError("DeviceEvent recorded twice without a wait in between")
        self._handle = self._backend.record(stream)
        self._recorded.set()

    def query(self) -> bool:
        """Recorded and its device work done: the check a step loop makes without waiting."""
        return self._recorded.is_set() and not self._stopped and self._backend.is_done(self._handle)

    async def wait(self, stream: Any = None) -> bool:
        """Wait for the recording, then for its device work; True once both happened, False if
        `stop()` ended the wait. Re-arms the event for the next cycle.

        Cancellation stops the wait and leaves the event as it was: a recording that happened
        stays pending for the next `wait`."""
        await self._recorded.wait()
        if self._stopped:
            return False
        await self._backend.wait(self._handle, stream)
        self._recorded = anyio.Event()
        self._handle = None
        return True

    def stop(self) -> None:
        """End the current and any later wait (they return False); later records raise."""
        self._stopped = True
        self._recorded.set()
