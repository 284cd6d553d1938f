"""The engine under trio's MockClock with a fake executor: exact virtual timings, timeouts as aborts."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine import RequestOutputKind, open_engine
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_each_step_costs_its_virtual_time(tiny_model_dir, autojump_clock):
    executor = FakeExecutor(step_time=0.05)
    async with open_engine(engine_config(tiny_model_dir), executor=executor) as engine:
        start = trio.current_time()
        out = await final_output(engine, [5, 6, 7], greedy(10, ignore_eos=True))
        elapsed = trio.current_time() - start
    assert len(out.outputs[0].token_ids) == 10
    assert elapsed == pytest.approx(10 * 0.05)  # one prefill step that samples, then nine decodes
    assert out.metrics["first_token_time"] - out.metrics["arrival_time"] == pytest.approx(0.05)


async def test_concurrent_requests_share_steps(tiny_model_dir, autojump_clock):
    executor = FakeExecutor(step_time=0.1)
    async with open_engine(engine_config(tiny_model_dir), executor=executor) as engine:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(final_output, engine, [i + 1, 2, 3], greedy(20, ignore_eos=True))
        elapsed = trio.current_time() - start
    assert elapsed == pytest.approx(20 * 0.1)  # continuous batching: 16 requests, 20 steps
    assert max(len(step.scheduled) for step in executor.steps) == 16


async def test_timeout_aborts_the_request_and_the_engine_goes_on(tiny_model_dir, autojump_clock):
    executor = FakeExecutor(step_time=0.05)
    async with open_engine(engine_config(tiny_model_dir), executor=executor) as engine:
        received = 0
        with trio.move_on_after(0.26) as scope:
            async for out in engine.generate([1, 2, 3], greedy(100, ignore_eos=True,
                                                                 output_kind=RequestOutputKind.DELTA)):
                received += len(out.outputs[0].token_ids)
        assert scope.cancelled_caught and received == 5
        await engine.core.wait_until_idle()
        assert engine.core.scheduler.kv.num_used_blocks == 0
        out = await final_output(engine, [4, 5], greedy(3, ignore_eos=True))
        assert out.outputs[0].finish_reason == "length"


async def test_stop_token_from_the_fake_model_finishes_with_stop(tiny_model_dir, autojump_clock):
    executor = FakeExecutor(step_time=0.01, token_fn=lambda rid, pos: 42 if pos == 6 else 7)
    async with open_engine(engine_config(tiny_model_dir), executor=executor) as engine:
        out = await final_output(engine, [1, 2, 3], greedy(50, stop_token_ids=[42]))
    assert out.outputs[0].token_ids == [7, 7, 7, 42] and out.outputs[0].stop_reason == 42


class FailingExecutor(FakeExecutor):
    async def execute_model(self, sched_out):
        if len(self.steps) == 3:
            raise RuntimeError("kernel exploded")
        return await super().execute_model(sched_out)


async def test_a_failing_step_ends_every_request_with_engine_dead_naming_the_cause(tiny_model_dir, autojump_clock):
    from engine import EngineDeadError
    errors = []

    async def consume(engine):
        try:
            await final_output(engine, [1, 2, 3], greedy(50, ignore_eos=True))
        except EngineDeadError as exc:
            errors.append(exc)
            raise

    # open_engine re-raises the step's error; each consumer got EngineDeadError.
    with pytest.RaisesGroup(RuntimeError, pytest.RaisesGroup(EngineDeadError, EngineDeadError)):
        async with (open_engine(engine_config(tiny_model_dir), executor=FailingExecutor()) as engine,
                    trio.open_nursery() as nursery):
            nursery.start_soon(consume, engine)
            nursery.start_soon(consume, engine)
    assert len(errors) == 2 and all("kernel exploded" in str(e) for e in errors)
    assert all(isinstance(e.__cause__, RuntimeError) for e in errors)
