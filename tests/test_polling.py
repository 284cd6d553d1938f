"""The executor's polling: the policy (poll only for messages expected within the window) and the
engine side's cooperative polling."""

from __future__ import annotations

import socket

import pytest
import trio

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
