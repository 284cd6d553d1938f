"""A lean trio byte stream over a connected socket, for the executor's worker connections.

`trio.SocketStream` takes two scheduler passes per `send_all` and per
`receive_some` even when the socket is ready (a cancellation check and a
checkpoint around every syscall). On the machine this was measured on, that
made a trio ping-pong between two processes cost ~120 us against ~50 us for
blocking sockets. Here a ready socket costs one syscall; only a socket that
is not ready parks the task (`wait_readable` / `wait_writable`, which are
cancellable). So these methods do not checkpoint when they need not wait:
callers loop on something that does (a memory channel, a wait).

Until `poll_until` (a `perf_counter()` time, set by the RPC layer from its
`PollPolicy`) an empty socket is polled instead of waited on: each try
gives the CPU away (`sched_yield`) so that the peer process can run on a
small machine, and with `cooperative` it also lets the loop's other tasks
run (the engine's side; a worker has nothing else to run and only spins).
"""

from __future__ import annotations

import operator
import os
import socket

import trio

from engine.ipc.polling import now

# What a socket that broke raises from this module, for callers that catch stream failures.
STREAM_BROKEN: tuple[type[Exception], ...] = (trio.BrokenResourceError, trio.ClosedResourceError)
# ... and what a frame reader raises besides when the peer closed its end.
STREAM_ENDED: tuple[type[Exception], ...] = (EOFError, *STREAM_BROKEN)


class FastSocketStream(trio.abc.HalfCloseableStream):
    """A `trio.abc.HalfCloseableStream` over a connected socket.

    It keeps trio's stream contract (checked by `trio.testing.check_half_closeable_stream`
    in `tests/test_fast_socket.py`): `BusyResourceError` for two concurrent senders or
    receivers, `ClosedResourceError` after `aclose` (also waking a task blocked in it),
    `BrokenResourceError` when the peer is gone, and argument checks. It drops exactly
    one guarantee: a call that need not wait (the socket is ready) does not checkpoint,
    so it is neither a cancellation point nor a scheduling point. That is the point of
    the class (see the module docstring); callers loop on something that checkpoints.
    """

    def __init__(self, sock: socket.socket, *, cooperative: bool = True) -> None:
        sock.setblocking(False)
        self.socket = sock
        self.cooperative = cooperative
        self.poll_until = 0.0
        self._closed = False
        self._sending = False  # a send_all or wait_send_all_might_not_block is in progress
        self._receiving = False
        self._eof_sent = False

    def try_send(self, data: bytes | memoryview) -> int:
        """Send what the socket takes now, without waiting; the number of bytes sent."""
        try:
            return self.socket.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._failure("send", exc) from exc

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Sends all of `data`. Cancellation is seen only while it waits for the socket to drain; a
        cancelled send may have sent part of `data`.
        """
        self._enter_send()
        if self._eof_sent:
            self._sending = False
            raise trio.ClosedResourceError("send_eof() was called: this side sends no more")
        try:
            view = memoryview(data).cast("B")
            while view:
                sent = self.try_send(view)
                view = view[sent:]
                if view:
                    await trio.lowlevel.wait_writable(self.socket)
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        """Cancellable wait for the socket to take more."""
        self._enter_send()
        try:
            await trio.lowlevel.wait_writable(self.socket)
        finally:
            self._sending = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to `max_bytes` bytes; b"" at end of stream. Cancellation is seen only while it waits
        (or polls): a ready socket returns at once.
        """
        max_bytes = 65536 if max_bytes is None else operator.index(max_bytes)
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._check_open()
        self._receiving = True
        try:
            while True:
                try:
                    return self.socket.recv(max_bytes)
                except BlockingIOError:
                    if now() < self.poll_until:
                        await self._yield()
                    else:
                        await trio.lowlevel.wait_readable(self.socket)
                except OSError as exc:
                    raise self._failure("receive", exc) from exc
        finally:
            self._receiving = False

    async def _yield(self) -> None:
        os.sched_yield()
        if self.cooperative:
            await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """Shut the sending side (the peer reads b""); not a cancellation point."""
        self._enter_send()
        try:
            if not self._eof_sent:
                self.socket.shutdown(socket.SHUT_WR)
                self._eof_sent = True
        except OSError as exc:
            raise self._failure("shutdown", exc) from exc
        finally:
            self._sending = False

    async def aclose(self) -> None:
        """Close the socket, waking any task blocked on it; a checkpoint, so it can raise
        `Cancelled` after closing.
        """
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()

    def _enter_send(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._check_open()
        self._sending = True

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream was closed")

    def _failure(self, what: str, exc: OSError) -> Exception:
        if self._closed:
            return trio.ClosedResourceError("the stream was closed")
        return trio.BrokenResourceError(f"socket {what} failed: {exc}")
