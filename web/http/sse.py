"""Server-Sent Events framing for OpenAI streams: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic_core import to_json

from engine.api import EngineDeadError, InvalidRequestError, RequestFailedError
from web.http.errors import APIError

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + to_json(payload) + b"\n\n"


def named_event(payload: dict[str, Any]) -> bytes:
    """An event whose SSE name is its payload's `type` (Anthropic's and the Responses API's)."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + to_json(payload) + b"\n\n"


@dataclass(frozen=True)
class Framing:
    """How one API writes its stream: an event's bytes, an error's payload, the closing bytes, and
    how one engine output's payload splits into events."""

    encode: Callable[[dict[str, Any]], bytes] = event
    error: Callable[[APIError], dict[str, Any]] = APIError.body
    done: bytes = DONE
    split: Callable[[Any], Iterable[dict[str, Any]]] = lambda chunk: _per_choice(chunk)


OPENAI = Framing()


class StreamStopper:
    """Ends the server's open streams cleanly, an error event then [DONE], when the shutdown
    grace period is about to run out: a client then sees why its stream ended, not a cut."""

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        self.stopping = False

    @contextmanager
    def guard(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope for one wait of one stream; `stop_all` cancels it."""
        with anyio.CancelScope() as scope:
            if self.stopping:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def stop_all(self) -> None:
        self.stopping = True
        for scope in list(self._scopes):
            scope.cancel()


SHUTTING_DOWN = APIError(503, "the server is shutting down; retry the request", code="server_shutting_down")


def _per_choice(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    choices = chunk.get("choices") or []
    return [chunk] if len(choices) <= 1 else [{**chunk, "choices": [choice]} for choice in choices]


async def stream_events(first: Any, rest: AsyncGenerator[Any], to_chunk: Callable[[Any], Any],
                        closing: Callable[[], Iterable[dict[str, Any]]],
                        stopper: StreamStopper | None = None, framing: Framing = OPENAI) -> AsyncGenerator[bytes]:
    """One event per engine output and choice (each carries every token since the previous one;
    with n > 1 or several prompts, one choice per chunk, as vLLM streams them), then the closing
    chunks and [DONE] (OpenAI's framing; another API's `framing` writes its own). An error
    mid-stream becomes one error event, and so does the server's shutdown (`stopper`). If the
    client goes away, the cancellation closes `rest`, which aborts the requests."""
    stopper = stopper or StreamStopper()
    try:
        item = first
        while item is not None:
            for chunk in framing.split(to_chunk(item)):
                yield framing.encode(chunk)
            with stopper.guard() as wait:
                item = await anext(rest, None)
            if wait.cancelled_caught:
                yield framing.encode(framing.error(SHUTTING_DOWN))
                break
        else:
            for chunk in closing():
                yield framing.encode(chunk)
    except InvalidRequestError as exc:
        yield framing.encode(framing.error(APIError(400, str(exc), param=exc.param)))
    except RequestFailedError as exc:
        yield framing.encode(framing.error(APIError(500, str(exc), code="request_failed")))
    except EngineDeadError as exc:
        yield framing.encode(framing.error(APIError(503, str(exc), code="engine_dead")))
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            await rest.aclose()
    if framing.done:
        yield framing.done
