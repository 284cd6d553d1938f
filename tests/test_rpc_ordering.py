"""Ordered RPC futures against fake workers over in-memory streams, in virtual time.

The workers run the real worker-side loop (`serve_worker`); only the Worker
object is fake, with async methods so that their durations are virtual.
"""

from __future__ import annotations

import random
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from engine.errors import EngineDeadError
from engine.executor.rpc import WorkerConnection, WorkerError, WorkerGroup
from engine.ipc import wire
from engine.worker.worker_main import Init, Ready, serve_worker


class FakeWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[int] = []

    async def echo(self, value, delay: float = 0.0):
        await trio.sleep(delay)
        self.seen.append(value)
        return (self.rank, value)

    async def boom(self, value):
        raise ValueError(f"boom {value}")

    def add(self, a, b):  # a plain method: runs in a worker thread, as the real Worker's do
        return a + b


@asynccontextmanager
async def fake_group(size: int):
    workers: list[FakeWorker] = []

    def build(init: Init) -> FakeWorker:
        workers.append(FakeWorker(init.rank))
        return workers[-1]

    async def serve(stream):
        async with stream:
            await serve_worker(stream, build)

    async with trio.open_nursery() as nursery:
        connections = []
        for rank in range(size):
            parent_end, child_end = trio.testing.memory_stream_pair()
            nursery.start_soon(serve, child_end)
            await wire.send(parent_end, Init(rank, size, None))
            reader = wire.FrameReader(parent_end)
            assert isinstance(await reader.receive(), Ready)
            connections.append(WorkerConnection(rank, parent_end, reader))
        group = WorkerGroup(connections)
        await nursery.start(group.run)
        yield group, workers, connections
        group.shutdown()


async def test_interleaved_calls_awaited_in_random_order_each_get_their_own_reply(autojump_clock):
    rng = random.Random(7)
    async with fake_group(2) as (group, workers, _):
        plan = []  # (index, kind, future)
        for i in range(120):
            kind = rng.choice(["ok", "ok", "ok", "raise", "timeout"])
            if kind == "raise":
                future = group.call("boom", (i,))
            elif kind == "timeout":  # the worker takes 5 s, the caller waits at most 1 s
                future = group.call("echo", (i, 5.0), timeout=1.0)
            else:
                future = group.call("echo", (i, rng.random()))
            plan.append((i, kind, future))
        rng.shuffle(plan)
        for i, kind, future in plan:
            if kind == "ok":
                assert await future.result() == [(0, i), (1, i)]
            elif kind == "raise":
                with pytest.raises(WorkerError, match=f"boom {i}$") as info:
                    await future.result()
                assert info.value.rank == 0 and "in boom" in info.value.remote_traceback
            else:
                try:
                    result = await future.result()
                except TimeoutError:
                    continue
                # Awaited late enough, a slow call may have finished within its deadline: still its own.
                assert result == [(0, i), (1, i)]
        # Every call ran, in order, on every worker (a timed-out call is abandoned, not unsent).
        sent = sorted(i for i, kind, _ in plan if kind != "raise")
        assert workers[0].seen == workers[1].seen == sent
        assert await group.collective_rpc("add", (2, 3)) == [5, 5]


async def test_awaiting_a_later_future_first(autojump_clock):
    async with fake_group(2) as (group, _, _):
        first = await group.collective_rpc("echo", ("first", 3.0), non_block=True)
        second = await group.collective_rpc("echo", ("second",), non_block=True)
        assert await second.result() == [(0, "second"), (1, "second")]
        assert await first.result() == [(0, "first"), (1, "first")]


async def test_a_cancelled_caller_never_takes_the_next_calls_reply(autojump_clock):
    async with fake_group(1) as (group, workers, connections):
        with trio.move_on_after(1.0) as scope:
            await group.collective_rpc("echo", ("abandoned", 2.0))
        assert scope.cancelled_caught
        assert await group.collective_rpc("echo", ("next",)) == [(0, "next")]
        assert workers[0].seen == ["abandoned", "next"] and not connections[0].pending


async def test_timeout_covers_the_whole_call(autojump_clock):
    async with fake_group(2) as (group, _, _):
        start = trio.current_time()
        with pytest.raises(TimeoutError):
            await group.collective_rpc("echo", ("slow", 4.0), timeout=3.0)
        assert trio.current_time() - start == pytest.approx(3.0)
        assert await group.collective_rpc("echo", ("after",)) == [(0, "after"), (1, "after")]


async def test_unique_reply_rank_makes_only_that_rank_reply(autojump_clock):
    async with fake_group(3) as (group, workers, connections):
        assert await group.collective_rpc("echo", ("only",), unique_reply_rank=2) == (2, "only")
        assert await group.collective_rpc("echo", ("all",)) == [(0, "all"), (1, "all"), (2, "all")]
        assert all(w.seen == ["only", "all"] for w in workers)  # every rank ran both calls
        assert all(not c.pending for c in connections)
        with pytest.raises(ValueError, match="not a rank"):
            group.call("echo", (1,), unique_reply_rank=3)


async def test_a_lost_worker_fails_pending_and_later_calls(autojump_clock):
    async with fake_group(2) as (group, _, connections):
        pending = group.call("echo", ("never", 10.0))
        await trio.sleep(1.0)  # virtual time: the call is now under way on both workers
        await connections[1].stream.aclose()  # as if rank 1's process died
        with pytest.raises(EngineDeadError, match="rank 1"):
            await pending.result()
        with pytest.raises(EngineDeadError, match="rank 1"):
            group.call("echo", ("later",))
