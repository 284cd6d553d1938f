"""ORCA load reports, as vLLM sends them: a request carrying `endpoint-load-metrics-format: TEXT`
(or `JSON`) gets an `endpoint-load-metrics` header on its completions / chat answer with the
engine's KV-cache usage and waiting queue, for load balancers that route by ORCA (Envoy's
`orca_load_report`). Other formats get no header, as in vLLM.
"""

from __future__ import annotations

import json

from engine.api import EngineStats

REQUEST_HEADER = "endpoint-load-metrics-format"
RESPONSE_HEADER = "endpoint-load-metrics"
# The paths whose answers carry a report (vLLM's: the generation endpoints).
REPORTING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch"})


def load_report(metrics_format: str, stats: EngineStats) -> str | None:
    """The header's value, or None for a format ORCA does not define."""
    named = {"kv_cache_usage_perc": float(stats.kv_cache_usage), "num_requests_waiting": float(stats.num_waiting)}
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": named})
    return None
