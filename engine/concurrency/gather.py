"""Run several async calls at once; the first failure cancels the others."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

T = TypeVar("T")


async def gather_first_failure(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Await every call concurrently; the results in input order.

    When a call raises, the calls still running are cancelled, and the error
    of the lowest-indexed failed call is raised as it is (not wrapped in an
    exception group): callers report "the first bad input" deterministically.
    Cancellation from outside cancels every call and propagates.
    """
    if len(calls) == 1:
        return [await calls[0]()]
    results: list[T | None] = [None] * len(calls)
    errors: dict[int, Exception] = {}

    async def run_into(index: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[index] = await call()
        except Exception as exc:  # recorded and re-raised below; the siblings stop now
            errors[index] = exc
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(run_into, index, call)
    if errors:
        raise errors[min(errors)]
    return results  # type: ignore[return-value]  # every slot is filled when no call failed
