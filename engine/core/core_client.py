"""The client side of the engine process: `CoreClient`, what `AsyncEngine` drives in the server process.

    async with engine.api.open_engine_process(EngineConfig(model=path), observer=metrics) as engine:
        ...  # the same AsyncEngine as open_engine's, over a CoreClient

The server process keeps what is per request and cheap (rendering, tokenizing, grammar compiling,
building `EngineCoreRequest`s) and the HTTP work; the engine process (`engine.core.engine_main`) runs the
scheduler, the executor and the model. The two share no GIL, so HTTP handling never waits for a
step's Python work, nor a step for the HTTP work. `AsyncEngine` drives a `CoreClient` as it
drives an in-process `EngineCore`: `submit`, `abort`, `stats()` and `dead`, all synchronous.

Outputs come back one frame per step for every request of the step; metrics observed in the
engine process travel with them and are replayed on this process's observer.

If the engine process dies (a crash, `kill -9`), every open request fails with
`EngineDeadError` naming how it ended, `dead` turns true at once (health checks answer 503), and
the failure is raised out of the `async with` block, as an in-process core's failure is.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import socket
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.abc
from anyio.abc import Process

from engine.core.engine_core import AddRequest, OutputSender, dead_error
from engine.core.engine_messages import (
    ABORT,
    ADD,
    CALL,
    Answer,
    CoreSnapshot,
    EngineFailed,
    EngineReady,
    EngineStartFailed,
    decode_output,
)
from engine.core.output_processor import RequestPrompt
from engine.core.stats import EngineStats, NullObserver, StatsObserver, replay
from engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from engine.ipc import wire
from engine.ipc.fast_socket import STREAM_BROKEN, STREAM_ENDED, FastSocketStream
from engine.ipc.polling import PollPolicy, now
from engine.ipc.process import describe_exit

STARTUP_TIMEOUT = 600.0  # loading and compiling a model
# How long the server polls for the engine's next step report when reports have lately come at most
# this far apart (`PollPolicy`): a small model's decodes, a report every millisecond or so. Sleeping
# on the socket instead leaves the server's CPU idle between reports, and the engine's write that
# wakes it cost the engine's CPU ~64 us a report on a 2-core VM (cProfile of the engine process at
# one stream), out of ~1 ms a token; docs/decisions.md "The server polls for a small model's step reports".
REPORT_POLL_WINDOW = 3e-3


@dataclass
class _PendingCall:
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class CoreClient:
    """The engine core of the engine process, as `AsyncEngine` sees a core (`CoreHandle`).

    `run` (a task) writes posted messages and reads the engine's step reports; it raises the
    engine's failure. `submit`, `abort` and `stats` never block.
    """

    def __init__(self, stream: FastSocketStream, reader: wire.FrameReader, process: Process,
                 ready: EngineReady, observer: StatsObserver | None = None) -> None:
        self.process = process
        self.ready = ready
        self.pid = ready.pid
        self.worker_pids = ready.worker_pids
        self._stream = stream
        self._reader = reader
        self._report_polling = PollPolicy(REPORT_POLL_WINDOW)
        self._observer: StatsObserver = observer or NullObserver()
        self._snapshot = CoreSnapshot(ready.stats, 0, 0, 0)
        self._stats = ready.stats  # the last stats a report carried
        self._streams: dict[str, OutputSender] = {}
        self._prompts: dict[str, RequestPrompt] = {}
        self._outbox_send, self._outbox = anyio.create_memory_object_stream[Any](math.inf)
        self._adds_sent = 0
        self._call_tokens = itertools.count()
        self._calls: dict[int, _PendingCall] = {}
        self.failure: BaseException | None = None
        self.closing = False

    # ---- the core's surface (CoreHandle) ------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self.failure is not None or self.closing or self._snapshot.core_dead

    def submit(self, message: AddRequest) -> None:
        """Send a request to the engine process. `EngineDeadError` once it has stopped."""
        if self.dead:
            raise EngineDeadError("the engine has stopped")
        rid = message.request_id
        if rid in self._streams:  # as the core refuses it
            message.outputs.send_nowait(InvalidRequestError(f"request id {rid!r} is already in use",
                                                            param="request_id", request_id=rid))
            message.outputs.close()
            return
        self._streams[rid] = message.outputs
        self._prompts[rid] = RequestPrompt.of(message.request)
        self._adds_sent += 1
        self._post((ADD, message.request))

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it finished or the engine stopped); its outputs end here now."""
        if self._forget(request_id) and not self.dead:
            self._post((ABORT, request_id))

    def stats(self) -> EngineStats:
        """The engine's state after its last step; requests still on their way count as waiting."""
        snapshot = self._snapshot
        stats = self._stats
        in_flight = self._adds_sent - snapshot.adds_received
        if in_flight:
            stats = replace(stats, num_waiting=stats.num_waiting + in_flight)
        if self.dead:
            stats = replace(stats, workers_alive=tuple(False for _ in stats.workers_alive))
        return stats

    def engine_stats(self) -> list[EngineStats]:
        """`[stats()]`: one engine."""
        return [self.stats()]

    @property
    def pids(self) -> tuple[int, ...]:
        """The engine process's pid."""
        return (self.pid,)

    # ---- for tests and benchmarks -------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self._snapshot.num_steps

    @property
    def num_requests(self) -> int:
        """Requests open in the engine process after its last step."""
        return self._snapshot.num_requests

    async def wait_until_idle(self) -> None:
        """Return once the engine process has applied every message sent before this call and
        has no request left (or has stopped). Cancellation just stops the wait."""
        with contextlib.suppress(EngineDeadError):
            await self._call("wait_until_idle")

    # ---- LoRA adapters (EngineCore's, in the engine process) ----------------------------------
    async def add_lora(self, name: str, path: str) -> None:
        """`EngineCore.add_lora` in the engine process: `LoRAError` for a bad adapter.
        Cancellation stops the wait; the engine process may still load it."""
        await self._call("add_lora", name, path)

    async def remove_lora(self, name: str) -> None:
        """`EngineCore.remove_lora` in the engine process. Cancellation stops the wait; the
        engine process still removes the adapter once no request uses it."""
        await self._call("remove_lora", name)

    async def _call(self, method: str, *args: Any) -> None:
        """Await the core's `method` in the engine process, after every message sent before it;
        raises its error, or `EngineDeadError` if the engine stops first."""
        if self.dead:
            raise EngineDeadError("the engine has stopped")
        token = next(self._call_tokens)
        pending = self._calls[token] = _PendingCall()
        try:
            self._post((CALL, token, method, args))
            await pending.done.wait()
        finally:
            self._calls.pop(token, None)
        if pending.error is not None:
            raise pending.error

    # ---- the task -----------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write posted messages, read step reports and watch the process, until cancelled (the
        owner's shutdown) or the engine fails: then every open request fails, and the failure
        (`EngineDeadError` naming how the process ended, or the core's own error) is raised."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_loop)
            tg.start_soon(self._watch_process)
            task_status.started()
            await self._read_loop()

    async def _read_loop(self) -> None:
        while True:
            waiting_since = now()
            self._stream.poll_until = self._report_polling.poll_until("report", waiting_since)
            try:
                frame = await self._reader.receive()
            except STREAM_ENDED:
                if self.closing:
                    await anyio.sleep_forever()  # the owner stops the process, then cancels us
                raise self._fail(await self._connection_lost_error()) from None
            self._report_polling.observe("report", now() - waiting_since)
            if isinstance(frame, EngineFailed):
                self._fail(frame.error)
                raise frame.error
            self._apply(*frame)

    def _apply(self, items: list[tuple[str, Any]], observed: list[tuple[str, tuple[Any, ...]]],
               snapshot: CoreSnapshot, answered: list[Answer]) -> None:
        replay(observed, self._observer)
        self._snapshot = snapshot
        if snapshot.stats is not None:  # None: unchanged (within a decode burst)
            self._stats = snapshot.stats
        for rid, encoded in items:
            sink = self._streams.get(rid)
            if sink is None:
                continue  # aborted here already
            if encoded is None:
                self._forget(rid)
                continue
            try:
                sink.send_nowait(decode_output(rid, encoded, self._prompts[rid]))
            except anyio.BrokenResourceError:
                self.abort(rid)  # the consumer went away without saying so
        for token, error in answered:
            pending = self._calls.pop(token, None)
            if pending is not None:  # else its caller stopped waiting
                pending.error = error
                pending.done.set()

    async def _connection_lost_error(self) -> EngineDeadError:
        with anyio.move_on_after(1.0):  # the process is probably dying: name how, if it does soon
            await self.process.wait()
        return self._exit_error()

    async def _watch_process(self) -> None:
        await self.process.wait()
        if not self.closing:
            raise self._fail(self._exit_error())

    def _exit_error(self) -> EngineDeadError:
        code = self.process.returncode
        if code is None:
            return EngineDeadError(f"the connection to the engine process (pid {self.pid}) was lost")
        return EngineDeadError(f"the engine process (pid {self.pid}) exited unexpectedly ({describe_exit(code)})")

    async def _write_loop(self) -> None:
        async for first in self._outbox:
            batch = [first]
            while True:
                try:
                    batch.append(self._outbox.receive_nowait())
                except anyio.WouldBlock:
                    break
            if self.closing:
                continue  # our sending side is shut: the engine process is stopping, and takes nothing more
            try:
                await wire.send(self._stream, batch)
            except STREAM_BROKEN:
                if not self.closing:  # shut down while this batch was being written: it is moot
                    raise

    def _post(self, message: Any) -> None:
        self._outbox_send.send_nowait(message)

    def _forget(self, request_id: str) -> bool:
        sink = self._streams.pop(request_id, None)
        self._prompts.pop(request_id, None)
        if sink is None:
            return False
        sink.close()
        return True

    def _fail(self, failure: BaseException) -> BaseException:
        """Every open request fails, naming `failure` (the first failure wins); returns it."""
        if self.failure is None:
            self.failure = failure
        self._end_open_requests(dead_error(self.failure))
        return self.failure

    def _end_open_requests(self, error: EngineDeadError) -> None:
        for rid in list(self._streams):
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._streams[rid].send_nowait(error)
            self._forget(rid)
        for pending in self._calls.values():
            pending.error = error
            pending.done.set()

    def shut_down(self) -> None:
        """Ask the engine process to stop: our sending side closes (at once, even while this
        task group is being cancelled), and it sees the end of its input. Requests still open end
        with `EngineDeadError`, as when an in-process engine closes."""
        self.closing = True
        with contextlib.suppress(OSError):
            self._stream.socket.shutdown(socket.SHUT_WR)
        self._end_open_requests(dead_error(None))


async def handshake(reader: wire.FrameReader, process: Process) -> EngineReady:
    """The engine process's first message: `EngineReady`, or the start-up failure it reports (raised).
    An engine process that exits first, or says nothing for `STARTUP_TIMEOUT`, fails the start too.

    Cancellation stops waiting; the caller stops the process."""
    with anyio.fail_after(STARTUP_TIMEOUT):
        try:
            message = await reader.receive()
        except STREAM_ENDED:
            code = await process.wait()
            raise ModelLoadError(f"the engine process exited during start-up ({describe_exit(code)})") from None
    if isinstance(message, EngineStartFailed):
        raise message.error
    if not isinstance(message, EngineReady):
        raise ModelLoadError(f"the engine process sent {type(message).__name__} instead of EngineReady")
    return message
