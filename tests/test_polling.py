"""The executor's polling: the policy (poll only for messages expected within the window) and the
engine side's cooperative polling."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from engine.core.core_client import CoreClient
from engine.core.engine_messages import CoreSnapshot, EngineReady
from engine.core.stats import EngineStats
from engine.ipc import wire
from engine.ipc.fast_socket import FastSocketStream
from engine.ipc.polling import PollPolicy, now


def test_a_new_kind_of_message_is_polled_for_once_to_learn():
    policy = PollPolicy(window=1e-3)
    assert policy.poll_until("ping", start=10.0) == pytest.approx(10.001)


def test_slow_messages_stop_the_polling_and_fast_ones_bring_it_back():
    policy = PollPolicy(window=1e-3, weight=0.5)
    policy.observe("execute_model", 8e-3)
    assert policy.poll_until("execute_model", start=1.0) == 0.0
    policy.observe("ping", 50e-6)
    assert policy.poll_until("ping", start=1.0) == pytest.approx(1.001)  # kinds are kept apart
    for _ in range(4):  # 8 ms -> 4.03 -> 2.01 -> 1.01 -> 0.5 ms: the mean comes under the window
        policy.observe("execute_model", 30e-6)
    assert policy.poll_until("execute_model", start=1.0) == pytest.approx(1.001)


def test_a_zero_window_never_polls():
    policy = PollPolicy(window=0.0)
    policy.observe("ping", 1e-6)
    assert policy.poll_until("ping", start=5.0) == 0.0


async def test_a_polling_reader_lets_the_loops_other_tasks_run_during_its_window():
    """The engine's side polls cooperatively: a task that must run before the reply can come
    (here, the sender itself) gets the loop while the reader polls, not after its window."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = FastSocketStream(ours)
        stream.poll_until = now() + 5.0  # long: a reader that never yields would spin all of it
        sent_while_polling = []

        async def send_later() -> None:
            await trio.lowlevel.checkpoint()
            sent_while_polling.append(now() < stream.poll_until)
            theirs.send(b"reply")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_later)
            assert await stream.receive_some() == b"reply"
        assert sent_while_polling == [True]


async def test_the_server_polls_for_step_reports_that_come_fast_and_sleeps_on_slow_ones():
    """The server's reader of the engine process's step reports (`CoreClient`) polls for the next
    one while they have lately come within `REPORT_POLL_WINDOW` (a small model's decodes), and
    sleeps on the socket once they come slower (a large model, an idle server)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = FastSocketStream(ours)
        stats = EngineStats(0, 0, 0.0, 0, 0, 0, None, None, (True,))
        ready = EngineReady(pid=0, info=None, sampling_defaults={}, stats=stats,
                            worker_pids=())
        client = CoreClient(stream, wire.FrameReader(stream), None, ready)  # no process: only the reader runs
        engine_side = FastSocketStream(theirs)
        report = ([], [], CoreSnapshot(stats, 0, 1, 0), [])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._read_loop)
            await wire.send(engine_side, report)  # at once: a short wait
            await trio.testing.wait_all_tasks_blocked()  # read; the next wait polled, then slept
            assert stream.poll_until > 0.0 and client.stats().num_running == 0
            for _ in range(20):  # lately, reports a second apart
                client._report_polling.observe("report", 1.0)
            await wire.send(engine_side, report)
            await trio.testing.wait_all_tasks_blocked()
            assert stream.poll_until == 0.0
            nursery.cancel_scope.cancel()
