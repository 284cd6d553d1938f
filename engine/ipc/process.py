"""Child processes of the engine: spawning one with a socket to it, stopping a set of them, and the
child's side of dying with its parent.

Shared by the multi-process executor (worker processes) and the engine process
(`engine.api.engine_process`), so both start, stop and describe their children alike.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress

import anyio
from anyio.abc import Process

SHUTDOWN_GRACE = 5.0  # each stage of the staged stop


async def spawn_with_socket(command: Sequence[str]) -> tuple[Process, socket.socket]:
    """Start `command` with one end of a socketpair as `--fd N` and this process as `--parent-pid`;
    return the process and our end. No port is opened. Cancellation during the spawn closes both
    ends (the child, if it started, sees its socket close and exits)."""
    ours, theirs = socket.socketpair()
    try:
        full = [*command, "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
        process = await anyio.open_process(full, stdin=subprocess.DEVNULL, stdout=None, stderr=None,
                                           pass_fds=(theirs.fileno(),))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


async def stop_processes(processes: Sequence[Process], ask: Callable[[], None] | None = None,
                         grace: float = SHUTDOWN_GRACE) -> None:
    """Ask (`ask()`), wait, SIGTERM, wait, SIGKILL, reap. Shielded: runs to the end even when the
    caller is cancelled; each wait lasts at most `grace` seconds."""
    with anyio.CancelScope(shield=True):
        if ask is not None:
            ask()
        for stage in (None, signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in processes if p.returncode is None]
            if stage is not None:
                for process in alive:
                    with suppress(ProcessLookupError):
                        process.send_signal(stage)
            with anyio.move_on_after(grace):
                for process in alive:
                    await process.wait()


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: "killed by SIGKILL", "exit code 1"."""
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def die_with_parent(parent_pid: int) -> None:
    """In a child: exit the moment the parent process does, even in the middle of a call.

    A thread waits on a pidfd of the parent (readable when it exits). Not
    `PR_SET_PDEATHSIG`: that fires when the parent *thread* that forked us
    exits, and trio spawns processes from its worker threads, which exit
    when idle (a worker was killed 10 s in)."""
    if not hasattr(os, "pidfd_open"):
        return  # elsewhere the closed socket still ends the child after its current call
    try:
        parent = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(1)  # the parent is already gone

    def wait_for_parent() -> None:
        select.select([parent], [], [])
        os._exit(1)

    # A thread, not a task: calls run inline on the loop's thread, and this must fire mid-call.
    threading.Thread(target=wait_for_parent, name="parent-watch", daemon=True).start()
