"""Starting the engine process (`engine.core.engine_main`), early when the server can.

`trio-llm serve` starts it before importing its HTTP stack and the engine API, through
`engine_process_started`, so the engine process imports torch while the server imports quart
and torch: on two cores the two overlap (docs/benchmarks.md).
`open_engine_process(spawned=...)` then adopts the process. This module imports neither torch
nor the engine API: the command line imports it first.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import anyio
from anyio.abc import Process

from engine.ipc.process import spawn_with_socket, stop_processes

ENGINE_COMMAND = (sys.executable, "-m", "engine.core.engine_main")


@dataclass(frozen=True)
class SpawnedEngine:
    """An engine process that has not yet received its configuration, and our end of its socket."""

    process: Process
    socket: socket.socket


async def spawn_engine(command: Sequence[str] = ENGINE_COMMAND) -> SpawnedEngine:
    """Start the engine process on this event loop's clock and log level. Cancellation during
    the spawn leaves nothing running (`spawn_with_socket`)."""
    offset = anyio.current_time() - time.perf_counter()
    level = logging.getLogger().getEffectiveLevel()
    arguments = [*command, "--clock-offset", repr(offset), "--log-level", str(level)]
    process, sock = await spawn_with_socket(arguments)
    return SpawnedEngine(process, sock)


@asynccontextmanager
async def engine_process_started(command: Sequence[str] = ENGINE_COMMAND) -> AsyncIterator[SpawnedEngine]:
    """Start the engine process now, for `open_engine_process(spawned=...)` inside the block.

    Leaving the block (normally, by an error, or cancelled) stops the process if it still runs
    and closes the socket, whether or not it was adopted: shielded and time limited
    (`stop_processes`)."""
    spawned = await spawn_engine(command)
    try:
        yield spawned
    finally:
        await stop_processes([spawned.process], partial(terminate, spawned.process))
        spawned.socket.close()


def terminate(process: Process) -> None:
    """SIGTERM `process` if it has not exited."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
