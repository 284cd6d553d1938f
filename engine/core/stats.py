"""What the engine core reports as it runs, for metrics.

The core calls a `StatsObserver` synchronously from its task, once per step
per request at most: implementations must be quick and must not block (the
HTTP layer's one updates Prometheus counters and histograms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class EplbStats:
    """Expert load balancing, for an engine running an MoE model with `enable_eplb`."""

    rebalances: int  # completed since start
    experts_moved: int  # expert slots whose weights changed, since start
    balancedness: tuple[float, ...]  # per MoE layer: mean / max load per rank, over the steps since the last rebalance
    rebalancing: bool  # an asynchronous rebalance is under way


@dataclass(frozen=True)
class EngineStats:
    """A read-only snapshot of a running engine (`AsyncEngine.stats()`), taken between steps.

    This is the surface the HTTP layer shows (`/metrics`, `/health`); it holds
    plain values, so reading it never touches the scheduler's state.
    """

    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, or submitted and not yet applied
    kv_cache_usage: float  # KV blocks referenced by live requests over all blocks, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int  # since start
    loop_lag: float | None  # seconds: the loop-lag probe's last reading (None: no probe, or no reading yet)
    loop_lag_max: float | None  # seconds: its largest reading since start
    workers_alive: tuple[bool, ...]  # one per worker (rank order); in-process: one, alive while the engine runs
    eplb: EplbStats | None = None  # None unless the engine balances experts
    # Images (vision-language models): encoder runs, encoder-cache reuse, and the EC connector.
    mm_encoder_runs: int = 0  # images encoded locally, since start
    encoder_cache_hits: int = 0  # image reads served by the encoder cache
    encoder_cache_evictions: int = 0
    encoder_cache_usage: float = 0.0  # rows held over the cache's capacity, 0..1
    ec_connector_loads: int = 0  # encoder outputs loaded through the EC connector
    ec_deferrals: int = 0  # scheduler steps a request was skipped while its images loaded
    # LoRA (--enable-lora): the adapters of the running and of the waiting requests, and --max-loras
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Of the waiting requests, those a gate held back at the last step (`Scheduler.num_deferred`):
    # vLLM's "deferred" reason; the rest wait for "capacity" (KV blocks, batch slots, token budget).
    num_waiting_deferred: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits over queries (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, for a request log: numbers only, never the prompt's text."""

    request_id: str
    finish_reason: str  # stop, length, abort, error
    prompt_tokens: int
    generation_tokens: int
    queue_time: float | None  # seconds from arrival to the first scheduled step (None: never scheduled)
    ttft: float | None  # seconds from arrival to the first token (None: no token)
    e2e: float  # seconds from arrival to the end
    n: int = 1  # samples asked for
    max_tokens: int | None = None  # the output-token limit it ran under (None: a pooling request)


class LoopLagReadings:
    """The loop-lag probe's readings: the last and the largest."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.max: float | None = None

    def record(self, lag: float) -> None:
        self.last = lag
        self.max = lag if self.max is None else max(self.max, lag)


class StatsObserver(Protocol):
    def on_first_token(self, ttft: float) -> None:
        """Seconds from arrival to the step that produced a request's first token."""

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        """Seconds since the request's previous output step, and how many tokens this step gave it."""

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        """A request (all of its `n` samples) finished, or was aborted (`finish_reason` "abort")."""

    def on_loop_lag(self, lag: float) -> None:
        """Seconds the loop-lag probe woke late (only with `EngineConfig.loop_lag_interval`)."""

    def on_scheduled(self, queue_time: float) -> None:
        """Seconds a request waited from arrival to its first scheduled step."""

    def on_request_done(self, record: RequestRecord) -> None:
        """A request finished, however it ended (after `on_finished`)."""

    def on_eplb_rebalance(self, seconds: float, experts_moved: int) -> None:
        """An expert rebalance finished: how long it took from start to the last layer adopted,
        and how many expert slots changed."""

    def on_step(self, num_tokens: int) -> None:
        """An engine step ran: the tokens it sampled and the prompts of the requests it began
        answering, over all requests (`engine_core.iteration_tokens`, vLLM's count)."""


class NullObserver:
    def on_first_token(self, ttft: float) -> None:
        pass

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        pass

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        pass

    def on_loop_lag(self, lag: float) -> None:
        pass

    def on_scheduled(self, queue_time: float) -> None:
        pass

    def on_request_done(self, record: RequestRecord) -> None:
        pass

    def on_eplb_rebalance(self, seconds: float, experts_moved: int) -> None:
        pass

    def on_step(self, num_tokens: int) -> None:
        pass


ObserverCall = tuple[str, tuple[Any, ...]]


class RecordingObserver:
    """A `StatsObserver` that records its calls, for another process's observer to `replay`.

    The engine process observes its core with one; the calls of each step travel to the server
    process with the step's outputs, where the server's metrics receive them. `on_record` runs
    after every call (the engine process uses it to know a step has something to send).
    """

    def __init__(self, on_record: Callable[[], None] = lambda: None) -> None:
        self.calls: list[ObserverCall] = []
        self._on_record = on_record

    def take(self) -> list[ObserverCall]:
        calls, self.calls = self.calls, []
        return calls

    def _record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        self._on_record()

    def on_first_token(self, ttft: float) -> None:
        self._record("on_first_token", ttft)

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        self._record("on_tokens", inter_token_latency, num_tokens)

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        self._record("on_finished", finish_reason, e2e_latency, prompt_tokens, generation_tokens)

    def on_loop_lag(self, lag: float) -> None:
        self._record("on_loop_lag", lag)

    def on_scheduled(self, queue_time: float) -> None:
        self._record("on_scheduled", queue_time)

    def on_request_done(self, record: RequestRecord) -> None:
        self._record("on_request_done", record)

    def on_eplb_rebalance(self, seconds: float, experts_moved: int) -> None:
        self._record("on_eplb_rebalance", seconds, experts_moved)

    def on_step(self, num_tokens: int) -> None:
        self._record("on_step", num_tokens)


REPLAYABLE = frozenset(name for name in vars(NullObserver) if name.startswith("on_"))


def replay(calls: list[ObserverCall], observer: StatsObserver) -> None:
    """Make `calls` (from a `RecordingObserver`) on `observer`, in order."""
    for name, args in calls:
        if name not in REPLAYABLE:
            raise ValueError(f"{name!r} is not a StatsObserver method")
        getattr(observer, name)(*args)
