"""`trio-llm bench serve`: load a running server and report what its clients see.

For each concurrency level: N streaming completions with random token-id
prompts of `input_len` and exactly `output_len` new tokens (`ignore_eos`),
at most `concurrency` in flight, bounded by `max_seconds`. Reported:
requests/s, output tokens/s, time to first token and inter-token latency
(between SSE events) at p50/p99. Also the latency of a 1-token completion at
concurrency 1, the per-request cost of the HTTP path.

The client is deliberately thin (trio sockets, no JSON parsing per event) so
that on a shared machine it takes as little CPU from the server as possible.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import trio

from bench import http


@dataclass
class RequestTiming:
    start: float
    first: float | None = None
    events: list[float] = field(default_factory=list)
    ok: bool = False


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _stream_completion(url: str, model: str | None, prompt: list[int], output_len: int,
                             api_key: str | None) -> RequestTiming:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
                               "temperature": 0}
    if model:
        payload["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timing = RequestTiming(time.perf_counter())
    stream = await http.open_request(url, "POST", "/v1/completions", payload, headers=headers)
    async with stream:
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return timing
            now = time.perf_counter()
            count = chunk.count(b"data: {")
            if count:
                timing.first = timing.first or now
                timing.events.extend([now] * count)
            if not seen and not chunk.startswith(b"HTTP/1.1 200"):
                return timing  # an error status: not counted
            if b'data: {"error"' in chunk or b'{"object":"error"' in chunk:
                return timing  # an error event in a 200 stream (vLLM's way): not counted
            seen = seen[-16:] + chunk
    timing.ok = True
    return timing


@dataclass
class LevelResult:
    concurrency: int
    completed: int
    elapsed: float
    output_tokens: int
    ttft: list[float]
    itl: list[float]

    def line(self) -> str:
        ms = 1000
        return (f"{self.concurrency:>11} {self.completed:>9} {self.completed / self.elapsed:>10.2f} "
                f"{self.output_tokens / self.elapsed:>12.1f} {_percentile(self.ttft, .5) * ms:>9.1f} "
                f"{_percentile(self.ttft, .99) * ms:>9.1f} {_percentile(self.itl, .5) * ms:>8.1f} "
                f"{_percentile(self.itl, .99) * ms:>8.1f}")


HEADER = ("concurrency  requests     req/s  output tok/s  ttft p50  ttft p99  itl p50  itl p99   (ms)")


async def run_level(url: str, model: str | None, concurrency: int, num_requests: int, input_len: int,
                    output_len: int, vocab: int, max_seconds: float, api_key: str | None, seed: int = 0) -> LevelResult:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(num_requests)]
    timings: list[RequestTiming] = []
    limiter = trio.CapacityLimiter(concurrency)

    async def one(prompt: list[int]) -> None:
        async with limiter:
            timings.append(await _stream_completion(url, model, prompt, output_len, api_key))

    start = time.perf_counter()
    with trio.move_on_after(max_seconds):
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
    elapsed = time.perf_counter() - start
    done = [t for t in timings if t.ok]
    ttft = [t.first - t.start for t in done if t.first]
    itl = [b - a for t in done for a, b in pairwise(t.events)]
    return LevelResult(concurrency, len(done), elapsed, len(done) * output_len, ttft, itl)


async def one_token_latency(url: str, model: str | None, api_key: str | None, repeats: int = 30) -> list[float]:
    latencies = []
    for i in range(repeats):
        timing = await _stream_completion(url, model, [5 + i % 50, 6, 7, 8], 1, api_key)
        if timing.ok:
            latencies.append(timing.events[-1] - timing.start)
    return latencies


async def run(url: str, concurrencies: list[int], num_requests: int, input_len: int, output_len: int,
              model: str | None = None, vocab: int = 1000, max_seconds: float = 120.0,
              api_key: str | None = None) -> str:
    url = url.rstrip("/")
    lines = [f"url={url} num_requests={num_requests} input_len={input_len} output_len={output_len}", HEADER]
    await run_level(url, model, 4, 4, input_len, 4, vocab, max_seconds, api_key, seed=99)  # warm-up
    for concurrency in concurrencies:
        result = await run_level(url, model, concurrency, num_requests, input_len, output_len, vocab,
                                 max_seconds, api_key)
        lines.append(result.line())
    latencies = await one_token_latency(url, model, api_key)
    lines.append(f"1-token completion, concurrency 1: p50 {_percentile(latencies, .5) * 1000:.2f} ms, "
                 f"p99 {_percentile(latencies, .99) * 1000:.2f} ms over {len(latencies)} requests")
    return "\n".join(lines)
