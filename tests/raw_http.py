"""A tiny HTTP/1.1 client over trio sockets, for checking bytes on the wire and for hanging up mid-stream."""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def _request_bytes(host: str, method: str, path: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def open_request(url: str, method: str, path: str, payload=None, *, body: bytes | None = None,
                       headers: dict[str, str] | None = None) -> trio.SocketStream:
    """Send a request and return the open connection (to read from, or to hang up on)."""
    parts = urlsplit(url)
    if payload is not None:
        body = json.dumps(payload).encode()
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    await stream.send_all(_request_bytes(parts.netloc, method, path, body, headers))
    return stream


async def request(url: str, method: str, path: str, payload=None, **kwargs) -> RawResponse:
    """One request; the body is read as its framing says (Content-Length or chunked)."""
    stream = await open_request(url, method, path, payload, **kwargs)
    async with stream:
        reader = _Reader(stream)
        head = await reader.until(b"\r\n\r\n")
        status_line, *header_lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int((await reader.until(b"\r\n")).split(b";")[0], 16):
                body += await reader.exactly(size)
                await reader.until(b"\r\n")
        else:
            body = await reader.exactly(int(headers.get("content-length", "0")))
    return RawResponse(int(status_line.split()[1]), headers, body)


class _Reader:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _more(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise EOFError("the server closed the connection mid-response")
        self.buffer += chunk

    async def until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            await self._more()
        data, _, self.buffer = self.buffer.partition(marker)
        return data

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._more()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body; asserts the framing is exact."""
    assert body.endswith(b"\n\n"), body[-50:]
    events = body.decode().split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: "):] for event in events]
