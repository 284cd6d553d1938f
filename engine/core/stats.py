"""What the engine core reports as it runs, for metrics.

The core calls a `StatsObserver` synchronously from its task, once per step
per request at most: implementations must be quick and must not block (the
HTTP layer's one updates Prometheus counters and histograms).
"""

from __future__ import annotations

from typing import Protocol


class StatsObserver(Protocol):
    def on_first_token(self, ttft: float) -> None:
        """Seconds from arrival to the step that produced a request's first token."""

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        """Seconds since the request's previous output step, and how many tokens this step gave it."""

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        """A request (all of its `n` samples) finished, or was aborted (`finish_reason` "abort")."""


class NullObserver:
    def on_first_token(self, ttft: float) -> None:
        pass

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        pass

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        pass
