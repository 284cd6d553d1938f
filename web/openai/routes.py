"""OpenAI's endpoints: completions, chat completions (and vLLM's batch form), the Responses API,
and vLLM's render endpoints."""

from __future__ import annotations

from quart_trio import QuartTrio

from web.http.state import ServerState
from web.openai import completions, render, responses


def register(app: QuartTrio, state: ServerState) -> None:
    """Add this family's routes to `app`."""
    completions.register(app, state)
    responses.register(app, state)
    render.register(app, state)
