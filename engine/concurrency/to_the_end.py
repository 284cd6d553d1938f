"""Running an operation to its end even when its caller is cancelled meanwhile."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")


async def run_to_the_end(operation: Callable[[], Awaitable[T]]) -> T:
    """Await `operation()` shielded from cancellation, then raise a cancellation that arrived
    meanwhile; otherwise return its result.

    For work whose half-done state nobody could use or undo, such as a model step: its caller
    learns of the cancellation only once the work has ended, so the work's owner (the worker's KV
    cache, the executor's reply stream) is consistent when the caller unwinds. The wait is as long
    as the operation: give it one that ends (a dead worker process fails its call at once).
    """
    with anyio.CancelScope(shield=True):
        result = await operation()
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result
