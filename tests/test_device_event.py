"""DeviceEvent: the anyio side is waited for first, the device side without blocking the loop."""

from __future__ import annotations

import threading

import pytest
import torch
import trio
import trio.testing

from engine.concurrency.device_event import CPU_BACKEND, CudaBackend, DeviceEvent, FakeDeviceBackend


async def wait_then_set(event: DeviceEvent, done: trio.Event) -> None:
    assert await event.wait()
    done.set()


async def test_wait_blocks_until_record():
    event = DeviceEvent()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_then_set, event, done)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # nothing recorded: the waiter must not pass (vLLM's no-op wait)
        assert not event.query()
        event.record()
        await done.wait()


async def test_recorded_but_not_done_on_the_device_keeps_waiting():
    backend = FakeDeviceBackend()
    event = DeviceEvent(backend)
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_then_set, event, done)
        event.record(stream="side")
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set() and not event.query()  # recorded, the device still busy
        assert backend.pending[0].stream == "side"
        assert backend.complete() == 1
        await done.wait()


async def test_reuse_over_many_cycles_with_a_fresh_anyio_event_each_time():
    event = DeviceEvent()
    seen = []

    async def consumer():
        for _ in range(50):
            assert await event.wait()
            seen.append(len(seen))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        for cycle in range(50):
            await trio.testing.wait_all_tasks_blocked()
            assert len(seen) == cycle  # the previous cycle's recording does not let this one through
            event.record()
    assert len(seen) == 50


async def test_a_second_record_before_the_wait_raises():
    event = DeviceEvent()
    event.record()
    with pytest.raises(RuntimeError, match="twice"):
        event.record()
    assert await event.wait()
    event.record()  # after the wait, the next cycle may record again


async def test_producer_and_consumer_order_their_use_of_a_shared_tensor():
    """The producer fills a buffer on its 'stream' (device work that completes later); the consumer
    reads it only after the event; the producer refills only after the consumer's own event."""
    backend = FakeDeviceBackend()
    buffer = torch.zeros(4)
    ready, consumed = DeviceEvent(backend), DeviceEvent(backend)
    read = []

    async def producer():
        for value in range(1, 4):
            buffer.fill_(value)
            ready.record()
            assert await consumed.wait()

    async def consumer():
        for _ in range(3):
            assert await ready.wait()
            read.append(buffer.tolist())
            consumed.record()

    async def device():
        while len(read) < 3 or backend.pending:
            await trio.testing.wait_all_tasks_blocked()
            backend.complete(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        nursery.start_soon(consumer)
        nursery.start_soon(device)
    assert read == [[1.0] * 4, [2.0] * 4, [3.0] * 4]


async def test_stop_ends_a_waiter_cleanly_under_mock_clock(autojump_clock):
    event = DeviceEvent(FakeDeviceBackend())
    results = []

    async def consumer():
        results.append(await event.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.sleep(3600)  # an hour of virtual time: the waiter is still there
        assert results == []
        event.stop()
    assert results == [False]
    with pytest.raises(RuntimeError, match="stopped"):
        event.record()


async def test_a_cancelled_wait_leaves_the_recording_for_the_next_wait():
    backend = FakeDeviceBackend()
    event = DeviceEvent(backend)
    event.record()
    with trio.move_on_after(0.01) as scope:
        await event.wait()  # device work never completes: times out
    assert scope.cancelled_caught
    backend.complete()
    assert await event.wait()


def test_cpu_backend_work_is_done_at_record():
    event = DeviceEvent(CPU_BACKEND)
    assert not event.query()
    event.record()
    assert event.query()


class HandOverCudaEvent:
    """Stands in for a `torch.cuda.Event` the device has not finished: `synchronize()` blocks its
    thread until the test says the device is done."""

    def __init__(self) -> None:
        self.device_done = threading.Event()
        self.synchronized_in: list[str] = []

    def query(self) -> bool:
        return self.device_done.is_set()

    def synchronize(self) -> None:
        self.synchronized_in.append(threading.current_thread().name)
        self.device_done.wait()


async def test_the_cuda_wait_is_woken_by_the_device_not_by_a_timer(autojump_clock):
    # Polling from the loop woke on trio's timers, whole epoll milliseconds each; the wait must
    # end when the device does, with virtual time standing still, and the loop free meanwhile.
    handle = HandOverCudaEvent()
    backend = CudaBackend()
    done = trio.Event()

    async def waiter():
        await backend.wait(handle, None)
        done.set()

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        try:
            await trio.testing.wait_all_tasks_blocked()  # the loop runs while the device is busy
            assert not done.is_set()
        finally:  # the device finishes whatever happens: the thread is never abandoned
            handle.device_done.set()
        await done.wait()
    assert trio.current_time() == start
    assert handle.synchronized_in and handle.synchronized_in[0] != threading.current_thread().name


async def test_a_cuda_event_already_done_is_not_handed_to_a_thread():
    handle = HandOverCudaEvent()
    handle.device_done.set()
    await CudaBackend().wait(handle, None)
    assert handle.synchronized_in == []
