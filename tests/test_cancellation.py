"""Cancelling consumers aborts their requests: no KV block stays allocated, the engine keeps serving."""

from __future__ import annotations

import random
from contextlib import aclosing

import trio
import trio.lowlevel

from engine import open_engine
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


async def test_200_requests_random_ones_cancelled_at_random_points(tiny_model_dir):
    rng = random.Random(20261121)
    finished, cancelled = [], []
    async with open_engine(engine_config(tiny_model_dir, num_kv_blocks=96, max_num_seqs=48)) as engine:
        async def consume(i: int) -> None:
            prompt = f"request {i} " + "text " * rng.randrange(1, 40)
            stop_after = rng.randrange(0, 12) if rng.random() < 0.5 else None
            how = rng.choice(["cancel", "close"])
            params = greedy(rng.randrange(4, 24), ignore_eos=True)
            seen = 0
            with trio.CancelScope() as scope:
                async with aclosing(engine.generate(prompt, params)) as stream:
                    out = None
                    async for out in stream:  # noqa: B007 -- the last output is checked below
                        seen += 1
                        if stop_after is not None and seen > stop_after:
                            if how == "cancel":
                                scope.cancel()
                                await trio.lowlevel.checkpoint()
                            break  # leaving aclosing closes the generator: the other way to abort
                    else:
                        finished.append(i)
                        assert out is not None and out.finished
            if scope.cancelled_caught or (stop_after is not None and i not in finished):
                cancelled.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(consume, i)
                if rng.random() < 0.3:
                    await trio.lowlevel.checkpoint()
        await engine.core.wait_until_idle()
        kv = engine.core.scheduler.kv
        assert len(cancelled) > 20 and len(finished) > 20
        assert kv.num_used_blocks == 0, "aborted requests left KV blocks allocated"
        assert engine.core.num_requests == 0 and not engine.core.scheduler.has_work()
        out = await final_output(engine, "still serving", greedy(5))
        assert len(out.outputs[0].token_ids) == 5


async def test_cancelled_request_frees_its_blocks_before_the_next_step(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        with trio.CancelScope() as scope:
            async for out in engine.generate("a long one", greedy(300, ignore_eos=True)):
                if len(out.outputs[0].token_ids) >= 3:
                    assert engine.core.scheduler.kv.num_used_blocks > 0
                    scope.cancel()
        steps_before = engine.core.num_steps
        await engine.core.wait_until_idle()
        assert engine.core.scheduler.kv.num_used_blocks == 0
        assert engine.core.num_steps - steps_before <= 1  # at most the step already in flight


async def test_closing_the_generator_sends_the_abort_immediately(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        stream = engine.generate("close me", greedy(300, ignore_eos=True))
        await stream.__anext__()
        assert engine.core.num_pending_messages == 0
        await stream.aclose()
        # The abort is queued by the time aclose() returns, not left to the garbage collector.
        assert engine.core.num_pending_messages == 1
        await engine.core.wait_until_idle()
        assert engine.core.scheduler.kv.num_used_blocks == 0
