"""Keeping HTTP/1.1 connections in step when a response goes out before its request's body is in.

An ASGI middleware around the Quart app (`app.asgi_app = KeepAliveGuard(app.asgi_app)`), so it
works under `trio-llm serve` and under hypercorn's own command line alike.

Why it exists (issue 36; hypercorn 0.18 + quart-trio 0.12, reproduced with a ten-line app): a
response that is sent before the request body has fully arrived (a 401 from the API-key check, a
413, a 400 from an early check) ends with hypercorn closing the connection, because h11 cannot start
the next request cycle while the client is still sending the body. Hypercorn does that close, and
the recycling of a connection that can be reused, *inside the app's last `send` call*. quart-trio
cancels its per-request nursery as soon as hypercorn has reported the request finished, which it
does earlier in that same call, so the cancellation lands in the middle of the close: the socket
stays open, the body's remaining bytes are read and dropped, and the next request on that
connection waits forever behind an h11 state machine nobody will advance. The same cancellation can
skip restarting the keep-alive idle timer after an ordinary response.

What this does, per HTTP/1.x request:
- The response's last message is sent in a shielded, time-limited scope, split so that only the end
  of the message (no body bytes) and hypercorn's recycle-or-close run under the shield.
- A response that starts before the body is in waits for the rest of a small body (at most
  `drain_bytes`, within `drain_seconds`): quart-trio reads it in the background anyway, and once it
  is in, the connection is reused as usual.
- A larger body, one whose size is unknown and goes past `drain_bytes`, or one that does not arrive
  in time is not waited for: the response says `Connection: close` and the connection is closed
  after it, so no client reuses it and no megabytes are read only to be dropped.

`Expect: 100-continue`: hypercorn answers `100 Continue` itself as soon as it has parsed the headers,
before the app runs, so a client that waits for it gets it, then the early 401 or 413, which (the
body being large or not yet sent) comes with `Connection: close`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]  # (scope, receive, send): quart and hypercorn type messages apart

DRAIN_BYTES = 256 << 10  # a refused body up to this size is read and dropped, keeping the connection
DRAIN_SECONDS = 2.0  # how long a response waits for such a body before it closes the connection instead
# The end of a response and hypercorn's recycle-or-close: no body bytes, only a socket shutdown at most.
FINISH_SECONDS = 5.0


class KeepAliveGuard:
    """ASGI middleware: every response on a kept-alive HTTP/1.x connection leaves the connection
    either ready for the next request or closed (see the module docstring). Other scopes (lifespan,
    HTTP/2, websockets) pass through unchanged.

    Cancellation: a request cancelled before its response ends is cancelled as before; only the
    final `send` of a response is shielded, for at most `FINISH_SECONDS`."""

    def __init__(self, app: ASGIApp, *, drain_bytes: int = DRAIN_BYTES, drain_seconds: float = DRAIN_SECONDS) -> None:
        self.app = app
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") not in ("1.0", "1.1"):
            await self.app(scope, receive, send)
            return
        body = _BodyProgress(scope, receive, self.drain_bytes)
        await self.app(scope, body.receive, _ResponseGuard(send, body, self.drain_seconds).send)


class _BodyProgress:
    """Watches the request body go past on its way to the app (quart reads it in the background)."""

    def __init__(self, scope: Message, receive: Receive, drain_bytes: int) -> None:
        self._receive = receive
        self.received = 0
        self.drain_bytes = drain_bytes
        length, chunked = _declared_body(scope)
        self.declared = length  # None: chunked, size unknown
        self.complete = not chunked and not length
        self.settled = trio.Event()  # the body is in, or it has grown past what we would drain
        if self.complete or (length is not None and length > drain_bytes):
            self.settled.set()

    @property
    def drainable(self) -> bool:
        return self.declared is None or self.declared <= self.drain_bytes

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
        elif message["type"] == "http.disconnect":
            self.complete = True  # nothing more will come: there is no connection to keep
        if self.complete or self.received > self.drain_bytes:
            self.settled.set()
        return message


class _ResponseGuard:
    def __init__(self, send: Send, body: _BodyProgress, drain_seconds: float) -> None:
        self._send = send
        self._body = body
        self._drain_seconds = drain_seconds

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self._start(message)
        elif kind == "http.response.body" and not message.get("more_body", False):
            await self._finish(message)
        else:
            await self._send(message)

    async def _start(self, message: Message) -> None:
        body = self._body
        if not body.complete and body.drainable:
            with trio.move_on_after(self._drain_seconds):
                await body.settled.wait()
        if not body.complete:
            headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self._send(message)

    async def _finish(self, message: Message) -> None:
        if message.get("body"):
            await self._send({**message, "more_body": True})
        with trio.CancelScope(shield=True), trio.move_on_after(FINISH_SECONDS):
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


def _declared_body(scope: Message) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked) from the request headers."""
    length: int | None = None
    chunked = False
    for name, value in scope.get("headers", []):
        name = name.lower()
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None  # h11 has already refused a malformed one
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return (None if chunked else length), chunked
