"""A keep-alive soak: one pooled HTTP client, every route, refusals mixed with 200s.

Every request must be answered within `timeout` seconds with the status its case expects,
whatever the request before it on the same connection got (issue 36: a response sent before the
request body was read once left the next request on that connection waiting forever). The client
is one `httpx.Client` limited to one connection, so every request after the first reuses a
connection that has just carried another answer. `tests/test_fuzz.py` runs it against the fuzzing
server; `trio-llm bench keepalive --url URL --api-key KEY` runs it against any server.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Case:
    """One request and the status it must get. `key`: "right", "wrong" or "none"."""

    method: str
    path: str
    body: Any = None  # JSON payload, or bytes sent as they are
    key: str = "right"
    expect: int = 200
    stream: bool = False


def cases(max_body_bytes: int, with_key: bool) -> list[Case]:
    """Every route with a good body, and every refusal this server gives (401 only `with_key`)."""
    completion = {"prompt": "Hello", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    good = [
        Case("POST", "/v1/completions", completion),
        Case("POST", "/v1/completions", {**completion, "stream": True}, stream=True),
        Case("POST", "/v1/chat/completions", chat),
        Case("POST", "/v1/chat/completions", {**chat, "stream": True}, stream=True),
        Case("POST", "/v1/embeddings", {"input": "hello there"}),
        Case("POST", "/pooling", {"input": "hello there"}),
        Case("POST", "/score", {"queries": "a cat", "documents": ["a dog"]}),
        Case("POST", "/tokenize", {"prompt": "Hello"}),
        Case("GET", "/v1/models"),
        Case("GET", "/health", key="none"),
    ]
    refused = [
        Case("POST", "/v1/completions", {**completion, "no_such_field": 1}, expect=400),
        Case("POST", "/v1/chat/completions", b"{not json", expect=400),
        Case("POST", "/v1/completions", {**completion, "model": "no-such-model"}, expect=404),
        Case("POST", "/v1/no-such-route", completion, expect=404),
        Case("GET", "/v1/completions", expect=405),
        Case("POST", "/v1/embeddings", b"x" * (max_body_bytes + 1), expect=413),
    ]
    if with_key:
        for path, body in (("/v1/completions", completion), ("/pooling", {"input": "hi"}),
                           ("/v1/embeddings", {"input": "hi"}), ("/score", {"queries": "a", "documents": ["b"]})):
            refused += [Case("POST", path, body, key="none", expect=401), Case("POST", path, body, key="wrong",
                                                                                expect=401)]
        refused.append(Case("POST", "/v1/chat/completions", {**chat, "stream": True}, key="wrong", expect=401))
    return good + refused


def schedule(all_cases: list[Case], count: int) -> Iterator[Case]:
    """`count` requests: every refusal followed in turn by every good case, so each kind of answer
    is followed on the connection by each kind of request."""
    good = [case for case in all_cases if case.expect == 200]
    refused = [case for case in all_cases if case.expect != 200]
    pairs = itertools.cycle(itertools.product(refused, good))
    return itertools.islice(itertools.chain.from_iterable(pairs), count)


@dataclass
class SoakReport:
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)  # hangs, transport errors and wrong statuses
    slowest: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        answered = sum(self.statuses.values())
        return (f"{answered} answered in {self.seconds:.1f} s (slowest {self.slowest * 1000:.0f} ms); statuses: "
                + ", ".join(f"{code} x{n}" for code, n in sorted(self.statuses.items()))
                + f"; failures: {len(self.failures)}" + "".join(f"\n  {f}" for f in self.failures[:20]))


def run(url: str, api_key: str | None, count: int = 300, timeout: float = 1.0,
        max_body_bytes: int = 16 << 20) -> SoakReport:
    """`count` requests on one kept-alive connection (re-opened only where the server closed it)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its line per request would drown the report
    report = SoakReport()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout, limits=limits) as client:
        for case in schedule(cases(max_body_bytes, api_key is not None), count):
            _send(client, case, api_key, report)
    report.seconds = time.perf_counter() - start
    return report


def _send(client: httpx.Client, case: Case, api_key: str | None, report: SoakReport) -> None:
    keys = {"right": api_key, "wrong": f"not-{api_key}", "none": None}
    key = keys[case.key] if api_key is not None else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body).encode()
    if body is not None:
        headers["Content-Type"] = "application/json"
    began = time.perf_counter()
    try:
        with client.stream(case.method, case.path, content=body, headers=headers) as response:
            text = response.read()
    except httpx.HTTPError as exc:
        report.failures.append(f"{case.method} {case.path} (key {case.key}): {type(exc).__name__}: {exc}")
        return
    report.slowest = max(report.slowest, time.perf_counter() - began)
    report.statuses[response.status_code] += 1
    if response.status_code != case.expect:
        report.failures.append(f"{case.method} {case.path} (key {case.key}): {response.status_code}, "
                               f"expected {case.expect}: {text[:200]!r}")
    elif case.stream and not text.rstrip().endswith(b"data: [DONE]"):
        report.failures.append(f"{case.method} {case.path}: the stream did not end with [DONE]")
