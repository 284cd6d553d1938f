"""Server-Sent Events framing for OpenAI streams: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import anyio
from pydantic_core import to_json

from engine.api import EngineDeadError, InvalidRequestError, RequestFailedError
from web.errors import APIError

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + to_json(payload) + b"\n\n"


async def stream_events(first: Any, rest: AsyncGenerator[Any], to_chunk: Callable[[Any], dict[str, Any]],
                        closing: Callable[[], Iterable[dict[str, Any]]]) -> AsyncGenerator[bytes]:
    """One event per engine output (each carries every token since the previous one),
    then the closing chunks and [DONE]. An error mid-stream becomes one error event.
    If the client goes away, the cancellation closes `rest`, which aborts the requests."""
    try:
        item = first
        while item is not None:
            yield event(to_chunk(item))
            item = await anext(rest, None)
        for chunk in closing():
            yield event(chunk)
    except InvalidRequestError as exc:
        yield event(APIError(400, str(exc), param=exc.param).body())
    except RequestFailedError as exc:
        yield event(APIError(500, str(exc), code="request_failed").body())
    except EngineDeadError as exc:
        yield event(APIError(503, str(exc), code="engine_dead").body())
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            await rest.aclose()
    yield DONE
