"""Kept-alive connections stay in step whatever the answer before (issue 36, web.http.keepalive).

A response sent before its request body was in (an early 401, 413, ...) once left hypercorn's h11
state behind, and the next request on that connection waited forever. In-process servers let
`wait_all_tasks_blocked` make the server answer from the headers alone, before the body is sent,
which is exactly the order that hung. Every wait here is bounded by `fail_after`: a hang fails.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial

import openai
import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, request
from quart_trio import QuartTrio
from trio.testing import wait_all_tasks_blocked

from bench.http import RawResponse, Reader, address, read_response
from tests.conftest import engine_config
from tests.server_fixtures import running_server
from web.http.keepalive import DRAIN_BYTES, KeepAliveGuard
from web.http.settings import ServerSettings
from web.serve import hypercorn_config

STATUSES = [401, 403, 400, 404, 405, 413, 415, 422, 429, 503]
# A hang detector, not a speed limit: under hypercorn's keep-alive timeout (5 s), after which a
# stuck connection would be closed rather than answered, and well above an answer's time on two
# busy cores (1 s was exceeded once in a full run, the other worker compiling).
ANSWER_SECONDS = 4.0


def refusing_app() -> QuartTrio:
    """Refuses with the status in X-Refuse from a before-request hook, the body unread (as our API-key
    check does); otherwise echoes the body's length."""
    app = QuartTrio("refusing")

    @app.before_request
    async def refuse() -> Response | None:
        status = request.headers.get("X-Refuse")
        return Response(b'{"error": "refused"}', status=int(status), content_type="application/json") \
            if status else None

    @app.post("/echo")
    async def echo() -> dict[str, int]:
        return {"bytes": len(await request.get_data())}

    app.asgi_app = KeepAliveGuard(app.asgi_app)  # type: ignore[method-assign]
    return app


@asynccontextmanager
async def serving(app: QuartTrio):
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        config = hypercorn_config("127.0.0.1", 0, ServerSettings(), log_level="warning")
        binds = await nursery.start(partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait))
        try:
            yield binds[0]
        finally:
            stop.set()


class RawConnection:
    """One kept-alive connection, written to and read from by hand."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = Reader(stream)

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        return cls(await trio.open_tcp_stream(*address(url)))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self) -> RawResponse:
        with trio.fail_after(ANSWER_SECONDS):
            return await read_response(self.reader)

    async def closed_by_server(self) -> bool:
        """True once the server has closed its end; a response or bytes instead are a failure."""
        with trio.fail_after(ANSWER_SECONDS):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset: the server closed with our body unread
                    return True
                if not data:
                    return True
                assert not data.strip(), f"bytes after a Connection: close answer: {data[:100]!r}"


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


GOOD = b'{"input": "hello"}'


def good_request(extra: dict[str, str] | None = None) -> bytes:
    return head("/echo", {"Content-Length": str(len(GOOD)), **(extra or {})}) + GOOD


async def expect_next_request_answered(conn: RawConnection) -> None:
    await conn.send(good_request())
    answer = await conn.response()
    assert answer.status == 200 and answer.json() == {"bytes": len(GOOD)}


@pytest.mark.parametrize("status", STATUSES)
async def test_a_refusal_before_a_small_body_keeps_the_connection_usable(status):
    """Headers first, the server refuses from them alone, then the body and the next request."""
    async with serving(refusing_app()) as url:
        for framing in ("length", "chunked"):
            conn = await RawConnection.open(url)
            if framing == "length":
                await conn.send(head("/echo", {"Content-Length": str(len(GOOD)), "X-Refuse": str(status)}))
            else:
                await conn.send(head("/echo", {"Transfer-Encoding": "chunked", "X-Refuse": str(status)}))
            await wait_all_tasks_blocked()  # the server has seen the headers and decided
            await conn.send(GOOD if framing == "length" else chunk(GOOD) + b"0\r\n\r\n")
            refused = await conn.response()
            assert refused.status == status and refused.headers.get("connection") != "close"
            await expect_next_request_answered(conn)
            await conn.stream.aclose()


@pytest.mark.parametrize("status", STATUSES)
async def test_a_refusal_before_a_large_body_closes_the_connection_at_once(status):
    """A declared body larger than what is worth draining, or a chunked one that grows past it: the
    refusal says Connection: close and the server closes without reading the rest."""
    async with serving(refusing_app()) as url:
        for framing in ("length", "chunked"):
            conn = await RawConnection.open(url)
            if framing == "length":
                await conn.send(head("/echo", {"Content-Length": str(1 << 30), "X-Refuse": str(status)}))
                await conn.send(b"x" * 1000)
            else:
                await conn.send(head("/echo", {"Transfer-Encoding": "chunked", "X-Refuse": str(status)}))
                for _ in range(DRAIN_BYTES // 32768 + 2):
                    await conn.send(chunk(b"x" * 32768))
            refused = await conn.response()
            assert refused.status == status and refused.headers.get("connection") == "close"
            assert await conn.closed_by_server()
        fresh = await RawConnection.open(url)
        await expect_next_request_answered(fresh)


async def test_a_small_body_that_never_comes_closes_the_connection_after_the_drain_wait(autojump_clock):
    async with serving(refusing_app()) as url:
        conn = await RawConnection.open(url)
        await conn.send(head("/echo", {"Content-Length": str(len(GOOD)), "X-Refuse": "401"}))
        with trio.fail_after(5):  # virtual time: the drain wait is 2 s
            refused = await read_response(conn.reader)
        assert refused.status == 401 and refused.headers.get("connection") == "close"
        assert await conn.closed_by_server()


async def test_expect_100_continue_is_answered_then_the_refusal_or_the_result():
    async with serving(refusing_app()) as url:
        refused = await RawConnection.open(url)
        await refused.send(head("/echo", {"Content-Length": str(1 << 30), "Expect": "100-continue",
                                         "X-Refuse": "413"}))
        # hypercorn answers 100 Continue as soon as it parses the headers (see web.http.keepalive); the
        # refusal follows without waiting for the body, and the connection closes.
        interim = await refused.response()
        assert interim.status == 100
        answer = await refused.response()
        assert answer.status == 413 and answer.headers.get("connection") == "close"
        assert await refused.closed_by_server()

        accepted = await RawConnection.open(url)
        await accepted.send(head("/echo", {"Content-Length": str(len(GOOD)), "Expect": "100-continue"}))
        assert (await accepted.response()).status == 100
        await accepted.send(GOOD)
        result = await accepted.response()
        assert result.status == 200 and result.json() == {"bytes": len(GOOD)}
        await expect_next_request_answered(accepted)


async def test_pipelined_requests_are_answered_in_order():
    async with serving(refusing_app()) as url:
        conn = await RawConnection.open(url)
        refused = head("/echo", {"Content-Length": str(len(GOOD)), "X-Refuse": "401"}) + GOOD
        await conn.send(refused + good_request() + refused + good_request())
        statuses = [(await conn.response()).status for _ in range(4)]
        assert statuses == [401, 200, 401, 200]


@pytest.fixture
async def keyed_server(tiny_model_dir):
    settings = ServerSettings(api_key="sekret", max_body_bytes=64 << 10)
    async with running_server(engine_config(tiny_model_dir, max_model_len=64), settings) as server:
        yield server


async def test_the_openai_client_answers_after_a_wrong_key_on_the_same_client(keyed_server):
    client = openai.AsyncOpenAI(base_url=f"{keyed_server.url}/v1", api_key="stale", max_retries=0,
                                timeout=ANSWER_SECONDS)
    model = keyed_server.state.model_name
    async with client:
        for _ in range(20):
            client.api_key = "stale"
            with pytest.raises(openai.AuthenticationError):
                await client.embeddings.create(model=model, input="hello")
            client.api_key = "sekret"
            reply = await client.embeddings.create(model=model, input="hello")
            assert len(reply.data[0].embedding) > 0


async def test_a_body_over_the_limit_is_refused_and_the_next_connection_answered_at_once(keyed_server):
    url = keyed_server.url
    conn = await RawConnection.open(url)
    # A gigabyte declared, a kilobyte sent: the 413 comes from the headers, and the connection closes.
    await conn.send(head("/v1/embeddings", {"Content-Length": str(1 << 30), "Authorization": "Bearer sekret"})
                    + b"x" * 1024)
    refused = await conn.response()
    assert refused.status == 413 and refused.headers.get("connection") == "close"
    assert "exceeds the limit" in refused.json()["error"]["message"]
    assert await conn.closed_by_server()
    fresh = await RawConnection.open(url)
    body = json.dumps({"input": "hello"}).encode()
    await fresh.send(head("/v1/embeddings", {"Content-Length": str(len(body)), "Authorization": "Bearer sekret"})
                     + body)
    assert (await fresh.response()).status == 200
