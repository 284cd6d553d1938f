"""When to poll a worker socket instead of sleeping on it.

Sleeping on a socket (epoll, then the kernel waking the process) costs tens
of microseconds per message on a virtual machine, and an event-loop pass on
each side costs as much again: an empty RPC took ~6x a bare blocking
ping-pong. Polling (trying the socket again, yielding the CPU between
tries) answers within microseconds, but burns CPU while it waits. So a
side polls only for a message it expects soon: `PollPolicy` keeps an
exponentially weighted mean of how long recent waits for the same kind of
message took, and grants a short polling window only when that mean is
below the window. A 10 ms model step is never polled for; an empty call
is; the first wait of each kind is polled for, once, to learn.

Times here come from `time.perf_counter()`: the window bounds CPU spent
spinning, which must be real elapsed time even under a test's mock clock.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

POLL_WINDOW = 500e-6  # seconds; a wait expected to be longer sleeps: the spin would cost more than the wake-up
EWMA_WEIGHT = 0.25


class PollPolicy:
    """An expected wait per key (an RPC method, or "the next call"), and the polling window it earns."""

    def __init__(self, window: float = POLL_WINDOW, weight: float = EWMA_WEIGHT) -> None:
        self.window = window
        self.weight = weight
        self._expected: dict[Hashable, float] = {}

    def poll_until(self, key: Hashable, start: float) -> float:
        """The `perf_counter()` time until which to poll for a message of kind `key` awaited from
        `start`; 0.0 (never) when such messages have lately taken longer than the window."""
        return start + self.window if self._expected.get(key, 0.0) < self.window else 0.0

    def observe(self, key: Hashable, waited: float) -> None:
        """Record that a message of kind `key` took `waited` seconds."""
        previous = self._expected.get(key)
        self._expected[key] = waited if previous is None else previous + self.weight * (waited - previous)


def now() -> float:
    return time.perf_counter()


def pollable(stream: Any) -> Any | None:
    """`stream` if it can be polled (a `FastSocketStream`: it has `poll_until`), else None
    (the memory streams of the tests)."""
    return stream if hasattr(stream, "poll_until") else None
