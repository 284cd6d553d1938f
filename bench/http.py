"""The one hand-written HTTP/1.1 client, over trio sockets: the benchmarks' load client and the
tests' wire-level client (checking bytes on the wire, hanging up mid-stream).

It is deliberately thin (no JSON parsing per SSE event, no connection pool
logic) so that on a shared 2-core machine the load it generates takes as
little CPU from the server as possible; `httpx` and the `openai` client are
what the tests use everywhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def address(url: str) -> tuple[str, int]:
    """(host, port) of an http URL (port 80 when it names none)."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    return parts.hostname, parts.port or 80


def request_bytes(host: str, method: str, path: str, body: bytes | None, headers: dict[str, str] | None,
                  keep_alive: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"] + ([] if keep_alive else ["Connection: close"])
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def open_request(url: str, method: str, path: str, payload: Any = None, *, body: bytes | None = None,
                       headers: dict[str, str] | None = None) -> trio.SocketStream:
    """Send a request and return the open connection (to read from, or to hang up on)."""
    if payload is not None:
        body = json.dumps(payload).encode()
    stream = await trio.open_tcp_stream(*address(url))
    await stream.send_all(request_bytes(urlsplit(url).netloc, method, path, body, headers))
    return stream


async def request(url: str, method: str, path: str, payload: Any = None, **kwargs: Any) -> RawResponse:
    """One request on its own connection; the body is read as its framing says."""
    stream = await open_request(url, method, path, payload, **kwargs)
    async with stream:
        return await read_response(Reader(stream))


async def read_response(reader: Reader) -> RawResponse:
    """One response: the head, then the body as its framing says (Content-Length or chunked)."""
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


class Connection:
    """A kept-alive connection, one request at a time (as HTTP clients' connection pools hold)."""

    def __init__(self, url: str, stream: trio.SocketStream) -> None:
        self.host = urlsplit(url).netloc
        self.stream = stream
        self.reader = Reader(stream)

    @classmethod
    async def open(cls, url: str) -> Connection:
        return cls(url, await trio.open_tcp_stream(*address(url)))

    async def post(self, path: str, body: bytes) -> RawResponse:
        await self.stream.send_all(request_bytes(self.host, "POST", path, body, None, keep_alive=True))
        return await read_response(self.reader)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Reader:
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
