"""A request's milestones (scheduled, tokens, finished) as `StatsObserver` calls.

The times are kept in the request's `RequestTracker.metrics` (they also go out
with its outputs); this turns them into the observer's latencies. Called from
the engine-core task only.
"""

from __future__ import annotations

from engine.core.output_processor import RequestTracker
from engine.core.stats import RequestRecord, StatsObserver


class RequestTimings:
    def __init__(self, observer: StatsObserver) -> None:
        self.observer = observer

    def scheduled(self, tracker: RequestTracker, now: float) -> None:
        """The request's first scheduled step (later ones, after a preemption, do not count)."""
        metrics = tracker.metrics
        if "scheduled_time" not in metrics:
            metrics["scheduled_time"] = now
            self.observer.on_scheduled(now - metrics["arrival_time"])

    def tokens(self, tracker: RequestTracker, num_tokens: int, now: float) -> None:
        if not num_tokens:
            return
        metrics = tracker.metrics
        if "first_token_time" not in metrics:
            metrics["first_token_time"] = now
            self.observer.on_first_token(now - metrics["arrival_time"])
        else:
            self.observer.on_tokens(now - metrics["last_token_time"], num_tokens)
        metrics["last_token_time"] = now

    def finished(self, tracker: RequestTracker, reason: str, now: float) -> None:
        generated = sum(len(c.token_ids) for c in tracker.children)
        metrics = tracker.metrics
        arrival = metrics["arrival_time"]
        self.observer.on_finished(reason, now - arrival, len(tracker.prompt_token_ids), generated)
        self.observer.on_request_done(RequestRecord(
            tracker.request_id, reason, len(tracker.prompt_token_ids), generated,
            metrics["scheduled_time"] - arrival if "scheduled_time" in metrics else None,
            metrics["first_token_time"] - arrival if "first_token_time" in metrics else None, now - arrival,
            n=tracker.params.n, max_tokens=_max_tokens(tracker)))


def _max_tokens(tracker: RequestTracker) -> int | None:
    request = tracker.children[0].request
    return None if request.pooling_params is not None else request.max_tokens
