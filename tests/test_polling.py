"""The executor's polling policy: poll a worker socket only for messages expected within the window."""

from __future__ import annotations

import pytest

from engine.executor.polling import PollPolicy


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
