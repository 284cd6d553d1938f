"""An event-loop lag probe: a task that sleeps a fixed interval and records how late it wakes.

Anything that holds the loop (a blocking call, a long synchronous stretch)
shows up as lateness. Time comes from the trio clock, so under `MockClock`
the probe reads exactly zero unless something blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus


async def run_loop_lag_probe(observe: Callable[[float], None], interval: float = 0.05, *,
                             task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled, calling `observe(lag_seconds)` after every interval."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    task_status.started()
    while True:
        start = anyio.current_time()
        await anyio.sleep(interval)
        observe(max(0.0, anyio.current_time() - start - interval))
