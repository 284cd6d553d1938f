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

import os
import socket

import trio

from engine.executor.polling import now


class FastSocketStream(trio.abc.Stream):
    def __init__(self, sock: socket.socket, *, cooperative: bool = True) -> None:
        sock.setblocking(False)
        self.socket = sock
        self.cooperative = cooperative
        self.poll_until = 0.0

    def try_send(self, data: bytes | memoryview) -> int:
        """Send what the socket takes now, without waiting; the number of bytes sent."""
        try:
            return self.socket.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket send failed: {exc}") from exc

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            sent = self.try_send(view)
            view = view[sent:]
            if view:
                await trio.lowlevel.wait_writable(self.socket)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.socket)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while True:
            try:
                return self.socket.recv(max_bytes or 65536)
            except BlockingIOError:
                if now() < self.poll_until:
                    await self._yield()
                else:
                    await trio.lowlevel.wait_readable(self.socket)
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket receive failed: {exc}") from exc

    async def _yield(self) -> None:
        os.sched_yield()
        if self.cooperative:
            await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        self.socket.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if self.socket.fileno() != -1:
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()
