"""Offloading blocking work: inline when it is small, in a worker thread under a limiter when not.

A thread hop costs 100-200 us here (measured: `trio-llm bench embed`); work
that takes less than that is cheaper on the loop. Every caller that sizes its
work (characters to tokenize, bytes to parse, floats to format) asks this one
function, so the policy is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def run_sized(fn: Callable[..., T], *args: object, size: int, inline_below: int,
                    limiter: anyio.CapacityLimiter) -> T:
    """`fn(*args)` on the loop when `size < inline_below`, else in a worker thread under `limiter`.

    Cancellation: inline work is not interruptible; offloaded work keeps
    running in its thread until it ends, and its result is dropped (anyio's
    `to_thread.run_sync` without `abandon_on_cancel`): the caller's cancel
    takes effect once the thread returns, so no thread outlives its caller.
    """
    if size < inline_below:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
