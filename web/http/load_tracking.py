"""vLLM's `--enable-server-load-tracking`: how many requests the model serves right now (the
generation and pooling routes, streamed answers until their last byte), read at `GET /load` as
`{"server_load": N}`. Counted around the ASGI call, which returns once the answer is sent."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json
from quart import Response
from quart_trio import QuartTrio

# The routes whose requests reach the model, as vLLM's `load_aware_call` marks them.
COUNTED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/invocations", "/v1/embeddings",
    "/pooling", "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})


class ServerLoad:
    """The count, and the ASGI wrapper that keeps it (a no-op unless tracking is on)."""

    def __init__(self, app: Any, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not (self.enabled and scope["type"] == "http" and scope["path"] in COUNTED_PATHS):
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def register(app: QuartTrio, load: ServerLoad) -> None:
    @app.get("/load")
    async def server_load() -> Response:
        """vLLM's answer: 0 while tracking is off."""
        return Response(to_json({"server_load": load.in_flight}), content_type="application/json")
