"""The worker side of the RPC: a trio program hosting one `Worker`, in a child process.

    python -m engine.worker.worker_main --fd N

The parent passes one end of a socketpair as fd N. First frame in: `Init`
(the config and this worker's rank); first frame out: `Ready`, or
`StartupFailed` with the traceback. Then calls run one at a time, in
order, each on the process's main thread (or awaited, for async methods:
the fake workers of the tests), with a `Reply` or `Failure` for every call
that asks for one. The process exits on `Shutdown`, when the parent's end
closes, and (on Linux) the moment the parent process exits, even mid-call,
so a killed parent leaves no orphan.
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import socket
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from engine.ipc import wire
from engine.ipc.fast_socket import FastSocketStream
from engine.ipc.polling import POLL_WINDOW, PollPolicy, now, pollable
from engine.ipc.process import die_with_parent
from engine.worker.worker_messages import Call, Failure, Init, Ready, Reply, Shutdown, StartupFailed, from_wire, to_wire


async def serve_worker(stream: trio.abc.Stream, build: Callable[[Init], Any]) -> None:
    """Serve one worker over `stream` until `Shutdown` or the stream ends.

    One loop: read a call, run it, reply. Calls run in order anyway, and
    running them on this thread costs less than handing them to another task
    or thread (measured: `trio-llm bench rpc`).

    Runs until the engine closes the connection; cancellation (the parent's death) ends it, and the
    process exits.
    """
    reader = wire.FrameReader(stream)
    init = await reader.receive()
    try:
        worker = build(init)
    except Exception:
        await wire.send(stream, StartupFailed(init.rank, traceback.format_exc()))
        return
    await wire.send(stream, Ready(init.rank, os.getpid()))
    try:
        await _serve_calls(stream, reader, worker, init)
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        return  # the parent is gone: nobody wants more results


async def _serve_calls(stream: trio.abc.Stream, reader: wire.FrameReader, worker: Any, init: Init) -> None:
    """Read a call, run it, reply; until `Shutdown`. After a reply, the socket is polled for the
    next call while calls have lately come soon after replies (see polling.py)."""
    policy = PollPolicy(POLL_WINDOW if init.poll else 0.0)
    socket_to_poll = pollable(stream)
    idle_since = None
    while True:
        message = from_wire(await reader.receive())
        if idle_since is not None:
            policy.observe("next call", now() - idle_since)
        if isinstance(message, Shutdown):
            return
        if not isinstance(message, Call):
            raise RuntimeError(f"unexpected message {type(message).__name__}")
        reply = await _run_call(worker, message)
        if message.reply_rank is None or message.reply_rank == init.rank:
            await wire.send(stream, to_wire(reply))
        idle_since = now()
        if socket_to_poll is not None:
            socket_to_poll.poll_until = policy.poll_until("next call", idle_since)


async def _run_call(worker: Any, call: Call) -> Reply | Failure:
    try:
        # A name of the worker's methods, or a function of the worker (vLLM's collective_rpc takes both).
        method = partial(call.method, worker) if callable(call.method) else getattr(worker, call.method)
        if inspect.iscoroutinefunction(method):
            value = await method(*call.args, **call.kwargs)
        else:
            # Inline: if the parent dies mid-call, the parent-watch thread ends this process.
            value = method(*call.args, **call.kwargs)
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


async def _main(fd: int) -> None:
    async with FastSocketStream(socket.socket(fileno=fd), cooperative=False) as stream:
        await serve_worker(stream, build_worker)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop (Ctrl-C reaches the group)
    trio.run(_main, args.fd)


if __name__ == "__main__":
    main()
