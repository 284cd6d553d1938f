"""Anthropic's Messages API."""

from __future__ import annotations

from quart_trio import QuartTrio

from web.anthropic import messages
from web.http.state import ServerState


def register(app: QuartTrio, state: ServerState) -> None:
    """Add this family's routes to `app`."""
    messages.register(app, state)
