"""Prometheus metrics for one server (one registry per app, so tests can run several).

Counters and histograms are fed by the engine core through the
`StatsObserver` interface; gauges read the engine's state when scraped (the
scrape runs on the event loop, between engine steps, so it reads a
consistent state without locks).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.api import EngineStats, RequestRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's: powers of two up to the batch's token budget.
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


request_log = logging.getLogger("trio_llm.requests")


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


class ServerMetrics:
    """Also the engine's `StatsObserver`."""

    def __init__(self, model_name: str, log_requests: bool = False) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("trio_llm_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("trio_llm_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("trio_llm_kv_cache_usage_ratio",
                              "KV blocks referenced by live requests over all blocks (prefix-cache-only blocks "
                              "count as free)", labels, registry=r)
        self.prompt_tokens = Counter("trio_llm_prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("trio_llm_generation_tokens", "Generated tokens", labels, registry=r)
        self.finished = Counter("trio_llm_requests_finished", "Finished requests by reason",
                                labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("trio_llm_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("trio_llm_inter_token_latency_seconds", "Time between output steps of a request",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("trio_llm_e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("trio_llm_event_loop_lag_seconds", "How late the loop-lag probe woke up",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.eplb_transfer = Histogram("trio_llm_eplb_transfer_seconds",
                                       "Expert rebalances, from start to the last layer adopted", labels,
                                       buckets=_TRANSFER_BUCKETS, registry=r)
        self._model = model_name
        self.log_requests = log_requests
        self.vllm = _VllmMetrics(r)
        self._stats_collector = _EngineStatsCollector(model_name)
        r.register(self._stats_collector)

    def bind(self, stats: Callable[[], EngineStats],
             engine_stats: Callable[[], list[EngineStats]] | None = None) -> None:
        """Read the gauges from the engine's `stats()` snapshot at every scrape (summed over
        data-parallel engines), and each engine's from `engine_stats()`."""
        self.running.labels(self._model).set_function(lambda: stats().num_running)
        self.waiting.labels(self._model).set_function(lambda: stats().num_waiting)
        self.kv_usage.labels(self._model).set_function(lambda: stats().kv_cache_usage)
        self._stats_collector.stats = stats
        self._stats_collector.engine_stats = engine_stats

    # ---- StatsObserver ------------------------------------------------------------------------
    def on_first_token(self, ttft: float) -> None:
        self.ttft.labels(self._model).observe(ttft)
        self.vllm.ttft.labels(self._model).observe(ttft)

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        self.itl.labels(self._model).observe(inter_token_latency)
        self.vllm.itl.labels(self._model).observe(inter_token_latency)

    def on_request_done(self, record: RequestRecord) -> None:
        """vLLM's per-request histograms; with --enable-log-requests, one JSON line per finished
        request (never the prompt's text)."""
        self.vllm.observe(self._model, record)
        if self.log_requests:
            request_log.info("%s", json.dumps({"request_id": record.request_id,
                                               "finish_reason": record.finish_reason,
                                               "prompt_tokens": record.prompt_tokens,
                                               "generation_tokens": record.generation_tokens,
                                               "queue_time": _rounded(record.queue_time),
                                               "ttft": _rounded(record.ttft), "e2e": _rounded(record.e2e)}))

    def on_scheduled(self, queue_time: float) -> None:
        self.vllm.queue_time.labels(self._model).observe(queue_time)

    def on_finished(self, finish_reason: str, e2e_latency: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        self.finished.labels(self._model, finish_reason).inc()
        self.e2e.labels(self._model).observe(e2e_latency)
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.generation_tokens.labels(self._model).inc(generation_tokens)
        self.vllm.success.labels(self._model, finish_reason).inc()
        self.vllm.e2e.labels(self._model).observe(e2e_latency)
        self.vllm.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.vllm.generation_tokens.labels(self._model).inc(generation_tokens)

    def on_loop_lag(self, lag: float) -> None:
        self.loop_lag.observe(lag)

    def on_eplb_rebalance(self, seconds: float, experts_moved: int) -> None:
        self.eplb_transfer.labels(self._model).observe(seconds)

    def on_step(self, num_tokens: int) -> None:
        self.vllm.iteration_tokens.labels(self._model).observe(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmMetrics:
    """The `vllm:` names dashboards and autoscalers read, beside the `trio_llm_` ones (both stay:
    docs/decisions.md). The engine-state ones come from `_EngineStatsCollector` at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels, r = ["model_name"], registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens_per_request = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, buckets=_TOKEN_BUCKETS,
            registry=r)
        self.generation_tokens_per_request = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", labels,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", labels,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", labels,
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", labels,
                                          buckets=_STEP_TOKEN_BUCKETS, registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                  buckets=(1, 2, 5, 10, 20), registry=r)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", labels,
                                           buckets=_TOKEN_BUCKETS, registry=r)

    def observe(self, model: str, record: RequestRecord) -> None:
        """A finished request's sizes, parameters and phases (prefill: scheduled to first token;
        decode: first token to the end; inference: scheduled to the end)."""
        self.prompt_tokens_per_request.labels(model).observe(record.prompt_tokens)
        self.generation_tokens_per_request.labels(model).observe(record.generation_tokens)
        if record.max_tokens is not None:  # generation requests (vLLM records these for them only)
            self.params_n.labels(model).observe(record.n)
            self.params_max_tokens.labels(model).observe(record.max_tokens)
        if record.queue_time is None:
            return
        self.inference_time.labels(model).observe(max(0.0, record.e2e - record.queue_time))
        if record.ttft is not None:
            self.prefill_time.labels(model).observe(max(0.0, record.ttft - record.queue_time))
            self.decode_time.labels(model).observe(max(0.0, record.e2e - record.ttft))


class _EngineStatsCollector:
    """Gauges and counters read from `AsyncEngine.stats()` when /metrics is scraped."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.stats: Callable[[], EngineStats] | None = None
        self.engine_stats: Callable[[], list[EngineStats]] | None = None

    def _per_engine(self) -> Iterator[GaugeMetricFamily]:
        """With data parallelism, what the load balancer reads, per engine (label `engine`, the
        data-parallel rank; vLLM's label name). The other families are summed over the engines."""
        per_engine = self.engine_stats() if self.engine_stats is not None else []
        if len(per_engine) < 2:
            return
        gauges = [("trio_llm_engine_requests_running", "Requests in one engine's running batch", "num_running"),
                  ("trio_llm_engine_requests_waiting", "Requests waiting in one engine", "num_waiting"),
                  ("trio_llm_engine_kv_cache_usage_ratio", "One engine's KV-cache usage, 0..1", "kv_cache_usage")]
        for name, text, field in gauges:
            gauge = GaugeMetricFamily(name, text, labels=["model_name", "engine"])
            for rank, stats in enumerate(per_engine):
                gauge.add_metric([self.model, str(rank)], getattr(stats, field))
            yield gauge

    def _waiting_by_reason(self, stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's `vllm:num_requests_waiting_by_reason`: held back by an admission gate
        ("deferred"), or waiting for room in the batch and the KV cache ("capacity")."""
        gauge = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                                  labels=["model_name", "reason"])
        gauge.add_metric([self.model, "capacity"], stats.num_waiting - stats.num_waiting_deferred)
        gauge.add_metric([self.model, "deferred"], stats.num_waiting_deferred)
        return gauge

    @staticmethod
    def _lora_info(stats: EngineStats) -> GaugeMetricFamily:
        """vLLM's `vllm:lora_requests_info`: the adapters running and waiting as labels, the time
        of the reading as the value."""
        gauge = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        gauge.add_metric([str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                          ",".join(stats.running_lora_adapters)], time.time())
        return gauge

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.stats is None:
            return
        stats, labels = self.stats(), ["model_name"]
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.",
                   stats.num_running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
                  ("trio_llm_encoder_cache_usage_ratio", "Encoder-cache rows held over its capacity",
                   stats.encoder_cache_usage)]
        for name, text, value in gauges:
            gauge = GaugeMetricFamily(name, text, labels=labels)
            gauge.add_metric([self.model], value)
            yield gauge
        yield self._waiting_by_reason(stats)
        yield from self._per_engine()
        counters = [("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     stats.num_preemptions),
                    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     stats.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     stats.prefix_cache_hits)]
        counters += [("trio_llm_mm_encoder_runs", "Images encoded locally", stats.mm_encoder_runs),
                     ("trio_llm_ec_connector_loads", "Encoder outputs loaded through the EC connector",
                      stats.ec_connector_loads),
                     ("trio_llm_ec_deferrals", "Scheduler steps a request was deferred while its encoder "
                      "outputs loaded", stats.ec_deferrals),
                     ("trio_llm_encoder_cache_hits", "Image reads served by the encoder cache",
                      stats.encoder_cache_hits),
                     ("trio_llm_encoder_cache_evictions", "Encoder outputs evicted from the encoder cache",
                      stats.encoder_cache_evictions)]
        if stats.max_lora:
            yield self._lora_info(stats)
        if stats.eplb is not None:
            counters += [("trio_llm_eplb_rebalances", "Expert rebalances completed", stats.eplb.rebalances),
                         ("trio_llm_eplb_experts_moved", "Expert slots whose weights a rebalance replaced",
                          stats.eplb.experts_moved)]
        for name, text, value in counters:
            counter = CounterMetricFamily(name, text, labels=labels)
            counter.add_metric([self.model], value)
            yield counter
        if stats.eplb is not None:
            balance = GaugeMetricFamily("trio_llm_eplb_balancedness",
                                        "Mean over max expert load per rank, per MoE layer, since the last "
                                        "rebalance (1: even)", labels=["model_name", "layer"])
            for layer, value in enumerate(stats.eplb.balancedness):
                balance.add_metric([self.model, str(layer)], value)
            yield balance
