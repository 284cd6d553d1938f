"""Joining a Ray cluster for the Ray executor, or starting a local one and stopping it again.

Three cases, one context manager (`ray_connected`):
- this process already called `ray.init` (a test's cluster, a user's script): used as it is, and
  left connected;
- `RAY_ADDRESS` names a cluster: joined, and left on the way out. A cluster that cannot be reached
  is one line (`ModelLoadError`) saying what to do;
- neither: a local instance with this machine's CPUs, started here and stopped on the way out.

The local instance needs care, each point seen in a failed start:
- Ray starts its daemons (gcs_server, raylet) with PR_SET_PDEATHSIG, and Linux sends that signal
  when the *thread* that started them exits. trio retires an idle worker thread after 10 s, so
  `ray.init` in an ordinary `to_thread.run_sync` call loses its cluster seconds later ("Failed to
  connect to GCS within 60 seconds"). Here one task keeps one worker thread for the instance's
  whole life: `ray.init`, then a wait on the event loop (`from_thread.run`), then `ray.shutdown`,
  all in that thread.
- Ray writes its session directory under `/tmp/ray` and, with token authentication (Ray's
  default for a new local cluster), a token to `~/.ray/auth_token`, where it outlives the server
  and is offered to the next cluster a user joins. Here the session lives in a temporary
  directory removed on the way out, failed start included, and the token is passed to Ray's
  processes in the environment (`RAY_AUTH_TOKEN`), never written to a file.
- `ray.init` puts Ray's failure handler on SIGTERM (it prints a C++ stack trace and kills the
  process) over this process's own: the engine process stops cleanly on SIGTERM, Ray included.
  The handler this process had is put back once Ray is up (from the main thread, the only one
  that may set handlers).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path

import anyio
import anyio.from_thread
import ray

from engine.config import usable_cpus
from engine.errors import ModelLoadError

# Ray's token variables: a user's own choice of authentication is left alone.
RAY_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@asynccontextmanager
async def ray_connected(num_cpus: int) -> AsyncIterator[None]:
    """Connected to Ray for the block (see the module docstring for which cluster). A local
    instance offers `num_cpus` CPUs (the workers' bundles), or this process's CPUs if more.

    Cancellation: leaving the block, however, disconnects, or stops the local instance and waits
    until its processes have exited (shielded; Ray's own shutdown has no time limit)."""
    if ray.is_initialized():
        yield
        return
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        async with _local_instance(max(num_cpus, usable_cpus())):
            yield
        return
    try:
        with _sigterm_handling_kept():
            await anyio.to_thread.run_sync(partial(ray.init, address=address, log_to_driver=False))
    except Exception as exc:
        raise ModelLoadError(f"cannot join the Ray cluster at RAY_ADDRESS={address} ({first_line(exc)}): start it "
                             "with `ray start --head`, or unset RAY_ADDRESS to run on a local Ray instance") from exc
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(ray.shutdown)


SESSION_PREFIX = "trio-llm-ray-"
# Ray's socket paths, `<root>/session_<date>_<time>_<pid>/sockets/plasma_store`, must fit AF_UNIX's
# 107 bytes: a root under a long TMPDIR does not, and /tmp is used instead.
SOCKET_PATH_BYTES, SESSION_PATH_BYTES = 107, 70


def _session_parent() -> str:
    parent = tempfile.gettempdir()
    longest_root = len(parent) + len(SESSION_PREFIX) + 20  # "/", the pid, "-", mkdtemp's 8 characters
    return parent if longest_root + SESSION_PATH_BYTES <= SOCKET_PATH_BYTES else "/tmp"


@asynccontextmanager
async def _local_instance(num_cpus: int) -> AsyncIterator[None]:
    _remove_stale_sessions()
    session_root = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{os.getpid()}-", dir=_session_parent())
    released = anyio.Event()
    try:
        async with anyio.create_task_group() as holder:
            with _sigterm_handling_kept():
                await holder.start(_hold_local_instance, session_root, num_cpus, released)
            try:
                yield
            finally:
                released.set()
    finally:
        shutil.rmtree(session_root, ignore_errors=True)


def _remove_stale_sessions() -> None:
    """Session directories of engine processes that no longer run: a process killed outright
    (SIGKILL) cannot remove its own."""
    for path in Path(_session_parent()).glob(f"{SESSION_PREFIX}*-*"):
        owner = path.name.removeprefix(SESSION_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


async def _hold_local_instance(session_root: str, num_cpus: int, released: anyio.Event, *,
                               task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Start a local Ray instance, report it started, and stop it once `released` is set, in one
    worker thread that lives as long as the instance (see the module docstring)."""
    try:
        await anyio.to_thread.run_sync(_run_local_instance, session_root, num_cpus, released, task_status.started)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot start a local Ray instance ({first_line(exc)}): start a cluster with "
                             "`ray start --head` and set RAY_ADDRESS to it") from exc


def _run_local_instance(session_root: str, num_cpus: int, released: anyio.Event, started: Callable[[], None]) -> None:
    with _token_in_environment():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _temp_dir=session_root)
        try:
            anyio.from_thread.run_sync(started)
            anyio.from_thread.run(_until_released, released)
        finally:
            ray.shutdown()


async def _until_released(released: anyio.Event) -> None:
    """Shielded: a cancelled engine still stops its workers through Ray before the instance goes
    (`released` is set after that, on the way out of `_local_instance`)."""
    with anyio.CancelScope(shield=True):
        await released.wait()


@contextmanager
def _sigterm_handling_kept() -> Iterator[None]:
    """This process's SIGTERM handling as it was before the block (see the module docstring);
    left to Ray where the block does not end on the main thread."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def _token_in_environment() -> Iterator[None]:
    """A fresh token for this instance, in the environment its processes inherit (so Ray writes
    no token file); the variables are restored afterwards. A user's own setting wins."""
    if any(name in os.environ for name in RAY_AUTH_VARIABLES):
        yield
        return
    # Ray itself then turns token mode on for the new cluster (RAY_AUTH_MODE), as its default is
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    try:
        yield
    finally:
        for name in RAY_AUTH_VARIABLES:
            os.environ.pop(name, None)


def first_line(error: BaseException) -> str:
    """Ray's errors run to many lines (ids, hints); an engine error names the cause in one."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

