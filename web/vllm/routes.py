"""vLLM's own endpoints: health and ping, version, models, tokenize and detokenize, and the LoRA adapters'."""

from __future__ import annotations

from quart_trio import QuartTrio

from web.http.state import ServerState
from web.vllm import admin, lora


def register(app: QuartTrio, state: ServerState) -> None:
    """Add this family's routes to `app`."""
    admin.register(app, state)
    lora.register(app, state)
