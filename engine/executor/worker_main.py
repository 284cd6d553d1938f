"""The worker side of the RPC: a trio program hosting one `Worker`, in a child process.

    python -m engine.executor.worker_main --fd N

The parent passes one end of a socketpair as fd N. First frame in: `Init`
(the config and this worker's rank); first frame out: `Ready`, or
`StartupFailed` with the traceback. Then calls run one at a time, in
order, each in a worker thread (or awaited, for async methods: the fake
workers of the tests), with a `Reply` or `Failure` for every call that asks
for one. The process exits on `Shutdown`, or at once when the parent's end
closes; on Linux it also dies with its parent (`PR_SET_PDEATHSIG`), so a
killed parent leaves no orphan.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import math
import os
import signal
import socket
import sys
import traceback
from functools import partial
from typing import Any, Callable

import anyio
import trio

from engine.executor import wire
from engine.executor.rpc import Call, Failure, Init, Ready, Reply, Shutdown, StartupFailed


async def serve_worker(stream: trio.abc.Stream, build: Callable[[Init], Any]) -> None:
    """Serve one worker over `stream` until `Shutdown` or the stream ends."""
    reader = wire.FrameReader(stream)
    init = await reader.receive()
    try:
        worker = build(init)
    except Exception:
        await wire.send(stream, StartupFailed(init.rank, traceback.format_exc()))
        return
    await wire.send(stream, Ready(init.rank, os.getpid()))
    calls_send, calls = anyio.create_memory_object_stream[Any](math.inf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_execute_calls, stream, worker, init.rank, calls, tg.cancel_scope)
        try:
            while True:
                calls_send.send_nowait(await reader.receive())
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            tg.cancel_scope.cancel()  # the parent is gone: nobody wants the results


async def _execute_calls(stream: trio.abc.Stream, worker: Any, rank: int, calls, scope: anyio.CancelScope) -> None:
    limiter = anyio.CapacityLimiter(1)
    async for message in calls:
        if isinstance(message, Shutdown):
            scope.cancel()
            return
        if not isinstance(message, Call):
            raise RuntimeError(f"unexpected message {type(message).__name__}")
        reply = await _run_call(worker, message, limiter)
        if message.reply_rank is None or message.reply_rank == rank:
            await wire.send(stream, reply)


async def _run_call(worker: Any, call: Call, limiter: anyio.CapacityLimiter) -> Reply | Failure:
    try:
        method = getattr(worker, call.method)
        if inspect.iscoroutinefunction(method):
            value = await method(*call.args, **call.kwargs)
        else:
            # abandon_on_cancel: if the parent goes away mid-call, the process exits without waiting.
            value = await anyio.to_thread.run_sync(partial(method, *call.args, **call.kwargs), limiter=limiter,
                                                   abandon_on_cancel=True)
        return Reply(call.seq, value)
    except Exception as exc:
        return Failure(call.seq, type(exc).__name__, str(exc), traceback.format_exc())


def build_worker(init: Init) -> Any:
    """The real Worker for a child process."""
    import torch

    from engine.worker.worker import Worker
    if init.torch_threads:
        torch.set_num_threads(init.torch_threads)
    return Worker(init.config, rank=init.rank, world_size=init.world_size,
                  distributed_init_method=init.distributed_init_method)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


async def _main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
        await serve_worker(stream, build_worker)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop (Ctrl-C reaches the group)
    trio.run(_main, args.fd)
    os._exit(0)  # an abandoned call's thread must not keep the process alive


if __name__ == "__main__":
    main()
