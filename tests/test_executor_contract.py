"""`Executor.execute_model`'s contract, on every executor: cancelling a step waits for the step in
flight to end, then raises (`EngineCore.step` relies on it: the worker's state stays consistent)."""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import replace

import pytest
import trio
import trio.testing

from engine import SamplingParams
from engine.core.open_core import build_scheduler
from engine.executor import create_executor
from engine.executor.inproc import InProcExecutor
from engine.sched.request import Request
from engine.testing import FakeExecutor, wait_for_writer
from tests.conftest import engine_config


async def test_the_fake_executor_finishes_a_cancelled_step_then_raises(autojump_clock):
    executor = FakeExecutor(step_time=1.0)
    config = engine_config("unused")
    scheduler = build_scheduler(config, replace(executor.info, num_kv_blocks=16, max_model_len=64))
    scheduler.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2), max_tokens=2))
    with trio.move_on_after(0.25) as scope:
        await executor.execute_model(scheduler.schedule())
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(1.0)  # the whole step, not the 0.25 s of the deadline
    assert len(executor.steps) == 1


def worker_idle(executor) -> bool:
    """No step of `executor`'s is still running: its worker thread returned, or every worker process
    replied to every call sent to it."""
    if isinstance(executor, InProcExecutor):
        return executor._limiter.borrowed_tokens == 0
    assert executor.group is not None
    return not any(connection.pending for connection in executor.group.connections)


@pytest.mark.parametrize("kind", ["inproc", "mp"])  # and "ray": tests/test_ray_executor.py, with its cluster
async def test_a_cancelled_step_ends_before_the_cancellation_is_raised(tiny_model_dir, kind):
    await check_a_cancelled_step_ends_before_the_cancellation_is_raised(tiny_model_dir, kind)


async def check_a_cancelled_step_ends_before_the_cancellation_is_raised(tiny_model_dir: str, kind: str) -> None:
    config = engine_config(tiny_model_dir, executor=kind)
    executor = create_executor(config)
    async with executor:
        info = await executor.load_model()
        await executor.initialize_kv_cache(64)
        scheduler = build_scheduler(config, replace(info, num_kv_blocks=64, max_model_len=256))
        scheduler.add_request(Request("long", list(range(1, 200)), SamplingParams(max_tokens=2), max_tokens=2))
        sched_out = scheduler.schedule()
        cancel_sent = threading.Event()
        release = None
        if kind != "inproc":
            # The workers hold the step behind a call that waits on a FIFO until the cancellation
            # is sent: a step whose reply arrived before the loop ever went idle tests nothing.
            fifo = os.path.join(tempfile.mkdtemp(), "hold")
            os.mkfifo(fifo)
            await executor.collective_rpc(wait_for_writer, (fifo,), non_block=True)

            def release() -> None:
                with open(fifo, "wb"):
                    pass
                os.unlink(fifo)
                os.rmdir(os.path.dirname(fifo))
        if kind == "inproc":
            # The worker thread holds its step until the cancellation is sent: a step that ends first
            # (the thread can starve the event loop of the GIL on a busy machine) tests nothing.
            run_step = executor.worker.execute_model

            def held_step(out):
                cancel_sent.wait(timeout=30)
                return run_step(out)

            executor.worker.execute_model = held_step
        async with trio.open_nursery() as nursery:
            cancelled = trio.Event()

            async def step() -> None:
                with trio.CancelScope() as scope:
                    nursery.start_soon(cancel_once_under_way, scope)
                    await executor.execute_model(sched_out)
                assert scope.cancelled_caught and worker_idle(executor)
                cancelled.set()

            async def cancel_once_under_way(scope: trio.CancelScope) -> None:
                await trio.testing.wait_all_tasks_blocked()  # the step is in its thread or with the workers
                assert not worker_idle(executor)
                scope.cancel()
                cancel_sent.set()
                if release is not None:
                    await trio.to_thread.run_sync(release)

            nursery.start_soon(step)
        assert cancelled.is_set()
        # The executor is still usable: the next step runs as usual.
        assert (await executor.execute_model(scheduler.schedule())) is not None
