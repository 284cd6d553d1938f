"""Property-based fuzzing of the HTTP API: no request may get a 5xx or take the engine down.

For every endpoint, a valid body with a few of its fields (and sometimes an
unknown one) replaced by hostile values: integers far outside every range
(2**64, -2**63 - 1, ...), floats, strings, lists, nested objects, nulls.
Hypothesis draws and shrinks them. `tests/test_fuzz.py` runs a bounded
number of examples in CI; `trio-llm bench fuzz` runs thousands against a
server and reports what it found.
"""

from __future__ import annotations

import collections
import json
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from web.anthropic.protocol import MessagesRequest
from web.chat.protocol import ChatCompletionRequest
from web.openai.protocol import CompletionRequest
from web.openai.responses_protocol import ResponsesRequest
from web.pooling.protocol import (
    ClassificationRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from web.vllm.protocol import DetokenizeRequest, TokenizeRequest

# A valid body per endpoint, and the request model whose fields get mutated.
ENDPOINTS: dict[str, tuple[dict[str, Any], Any]] = {
    "/v1/completions": ({"prompt": "Hello there", "max_tokens": 4}, CompletionRequest),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                             ChatCompletionRequest),
    "/v1/embeddings": ({"input": "Hello there"}, EmbeddingRequest),
    "/pooling": ({"input": "Hello there"}, PoolingRequest),
    "/score": ({"queries": "a cat", "documents": ["a dog", "a car"]}, ScoreRequest),
    "/rerank": ({"query": "a cat", "documents": ["a dog", "a car"]}, RerankRequest),
    "/tokenize": ({"prompt": "Hello there"}, TokenizeRequest),
    "/detokenize": ({"tokens": [5, 6, 7]}, DetokenizeRequest),
    "/v1/messages": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, MessagesRequest),
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 4}, ResponsesRequest),
    "/v2/embed": ({"texts": ["Hello there"]}, CohereEmbedRequest),
    "/classify": ({"input": "Hello there"}, ClassificationRequest),
}

EDGE_INTEGERS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100,
                 -(2**31), -(2**63), -(2**63) - 1, -(2**64)]


def hostile_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.sampled_from(EDGE_INTEGERS), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([1e308, -1e308, 1e-308, 0.5, 2.5]), st.booleans(), st.none(),
        st.text(max_size=20), st.sampled_from(["", " ", "\x00", "<|im_end|>", "Infinity", "NaN"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def integers() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGE_INTEGERS), st.integers(-3, 300), st.integers())


def typed_values(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of the field's own type, weighted to the edges: they pass parsing and reach the engine."""
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return integers()
    if annotation is float:
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False), integers(),
                         st.sampled_from([0.0, 1.0, 2.0, -2.0, 1e-9, 1e308]))
    if annotation is str:
        return st.text(max_size=30)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        return st.one_of([typed_values(a) for a in args if a is not type(None)] + [st.none()])
    if origin is list:
        return st.lists(typed_values(args[0]) if args else hostile_values(), max_size=5)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_values(annotation)
    return hostile_values()


def model_values(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A nested object (response_format, structured_outputs, ...): some of its own keys, each of
    its own type or anything at all, so wrong shapes one level down get sent too."""
    fields = {field.alias or name: field.annotation for name, field in model.model_fields.items()}
    return st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({key: st.one_of(typed_values(fields[key]), hostile_values())
                                              for key in chosen}))


def field_values(model: Any, name: str) -> st.SearchStrategy[Any]:
    if name not in model.model_fields:
        return hostile_values()
    return st.one_of(typed_values(model.model_fields[name].annotation), hostile_values())


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Valid bodies of `path` with up to three fields replaced: mostly by values of the field's own
    type at its edges (2**64, -1, ...), sometimes by anything at all."""
    base, model = ENDPOINTS[path]
    names = sorted(model.model_fields) + ["not_a_field"]
    changes = st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: field_values(model, name) for name in chosen}))
    return changes.map(lambda replaced: {**base, **replaced})


def requests() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    return st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda path: st.tuples(st.just(path), bodies(path)))


def encode(body: dict[str, Any]) -> bytes:
    """JSON as a client would send it; floats JSON cannot hold are sent as the tokens Python writes."""
    return json.dumps(body, allow_nan=True).encode()


@dataclass
class FuzzReport:
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)  # 5xx answers and transport errors
    seconds: float = 0.0

    def record(self, path: str, body: bytes, response: httpx.Response | Exception) -> None:
        if isinstance(response, Exception):
            self.failures.append(f"{path} {body[:300]!r}: {type(response).__name__}: {response}")
            return
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.failures.append(f"{path} {body[:300]!r}: {response.status_code} {response.text[:300]}")


def send(client: httpx.Client, path: str, body: dict[str, Any], report: FuzzReport) -> None:
    payload = encode(body)
    try:
        response: httpx.Response | Exception = client.post(path, content=payload,
                                                           headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        response = exc
    report.record(path, payload, response)


def still_serving(client: httpx.Client) -> str | None:
    """None if the server is healthy and answers a normal completion; otherwise what is wrong."""
    try:
        health = client.get("/health")
    except httpx.HTTPError as exc:
        return f"/health unanswered: {type(exc).__name__}: {exc}"
    if health.status_code != 200:
        return f"/health answers {health.status_code}"
    completion = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    if completion.status_code != 200:
        return f"a normal completion answers {completion.status_code}: {completion.text[:200]}"
    return None


def run(url: str, count: int, seed: int = 0, api_key: str | None = None) -> str:
    """`count` fuzzed requests against the server at `url` (with `api_key` if it needs one); a report of
    what came back."""
    report = FuzzReport()
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        @settings(max_examples=count, database=None, deadline=None, derandomize=seed == 0,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def fuzz(request: tuple[str, dict[str, Any]]) -> None:
            send(client, request[0], request[1], report)

        (fuzz if seed == 0 else hypothesis.seed(seed)(fuzz))()
        problem = still_serving(client)
    report.seconds = time.perf_counter() - start
    lines = [f"{count} examples drawn, {sum(report.statuses.values())} answered in {report.seconds:.1f} s "
             f"({sum(report.statuses.values()) / max(report.seconds, 1e-9):.0f} requests/s)",
             "statuses: " + ", ".join(f"{code} x{n}" for code, n in sorted(report.statuses.items())),
             f"5xx or transport errors: {len(report.failures)}",
             f"afterwards: {'healthy, and a normal completion is answered' if problem is None else problem}"]
    lines += [f"  {failure}" for failure in report.failures[:20]]
    return "\n".join(lines)
