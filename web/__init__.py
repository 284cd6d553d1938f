"""trio-llm web layer: the OpenAI-compatible HTTP server (Quart-Trio on hypercorn) lands here."""
