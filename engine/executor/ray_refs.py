"""Ray's ObjectRefs, awaited from trio.

`ray.get` blocks its thread until the object exists, so awaiting it through
`to_thread.run_sync` would hold one thread per outstanding call. Instead Ray's
own completion callback (`ObjectRef.future()`, run on Ray's thread when the
object is ready or its task failed) hands the settled future to the trio run
with `TrioToken.run_sync_soon`, which wakes the waiting task: no thread of ours
per ref, and the event loop never blocks.
"""

from __future__ import annotations

import concurrent.futures
from contextlib import suppress
from typing import Any

import trio


async def settled(ref: Any) -> concurrent.futures.Future[Any]:
    """Wait until the ObjectRef `ref` has its value or its error; return Ray's settled future
    (`.result()` gives the value or raises the task's error).

    Cancellation stops the wait only: the task behind `ref` runs on (cancel it with Ray, or kill
    its actor), and its late callback finds nobody waiting.
    """
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future: concurrent.futures.Future[Any] = ref.future()

    def wake(_: concurrent.futures.Future[Any]) -> None:  # on Ray's thread, or here if already done
        with suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    future.add_done_callback(wake)
    await done.wait()
    return future


async def get(ref: Any) -> Any:
    """The value behind `ref` (`ray.get`, awaited), or its task's error raised.

    Cancellation stops the wait only (see `settled`)."""
    return (await settled(ref)).result()
