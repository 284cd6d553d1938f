"""The pooling endpoints: embeddings, pooling, classify, score, rerank, and Cohere's /v2/embed."""

from __future__ import annotations

from quart_trio import QuartTrio

from web.http.state import ServerState
from web.pooling import cohere, handlers


def register(app: QuartTrio, state: ServerState) -> None:
    """Add this family's routes to `app`."""
    handlers.register(app, state)
    cohere.register(app, state)
