"""`trio-llm bench overload`: how fast a running server answers the small things while overloaded.

Two loads, each measured beside the floor (the same probe on the idle server, in the same run):

- `streams`: N streaming completions in a loop (more than `--max-num-seqs`, so most wait in the
  queue), while `/health` is asked every 50 ms: its p50, p99 and worst answer.
- `huge prompt`: one completion whose text is far beyond the context (15 MiB by default), while a
  small completion is asked every 50 ms: how long the refusal took, and the small ones' latency;
  then the same text with `truncate_prompt_tokens: 8`, which is served, so the whole text is
  tokenized (seconds of a worker thread) while the small ones are asked.

The client is `bench.http` on trio (one process, a few lines of socket code per request), so
what it measures is the server's time, not the client's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio

from bench.http import request

PROBE_INTERVAL = 0.05
SMALL = {"prompt": "hello there", "max_tokens": 2}


@dataclass
class Latencies:
    seconds: list[float]

    def line(self, label: str) -> str:
        ordered = sorted(self.seconds) or [float("nan")]

        def at(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3

        return (f"{label:<34} n={len(ordered):<5} p50 {at(0.5):7.1f} ms  p99 {at(0.99):7.1f} ms  "
                f"max {ordered[-1] * 1e3:7.1f} ms")


async def _probe(url: str, method: str, path: str, payload: object, until: trio.Event | float) -> Latencies:
    seen = []
    while not (until.is_set() if isinstance(until, trio.Event) else trio.current_time() >= until):
        start = time.perf_counter()
        response = await request(url, method, path, payload)
        seen.append(time.perf_counter() - start)
        if response.status >= 500:
            raise RuntimeError(f"{path} answered {response.status}")
        await trio.sleep(PROBE_INTERVAL)
    return Latencies(seen)


async def _streams(url: str, streams: int, seconds: float, max_tokens: int) -> tuple[Latencies, int]:
    stop = trio.current_time() + seconds
    finished = 0

    async def client() -> None:
        nonlocal finished
        body = {"prompt": "hello there engine", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        while trio.current_time() < stop:
            await request(url, "POST", "/v1/completions", body)
            finished += 1

    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(client)
        health = await _probe(url, "GET", "/health", None, stop)
    return health, finished


async def _huge_prompt(url: str, mib: float, **fields: object) -> tuple[Latencies, float, int, str]:
    text = ("hello world the engine says " * (int(mib * 2**20) // 28 + 1))[:int(mib * 2**20)]
    done = trio.Event()
    outcome: list[tuple[float, int, str]] = []

    async def refused() -> None:
        start = time.perf_counter()
        response = await request(url, "POST", "/v1/completions", {"prompt": text, "max_tokens": 2, **fields})
        outcome.append((time.perf_counter() - start, response.status, response.body[:120].decode(errors="replace")))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(refused)
        small = await _probe(url, "POST", "/v1/completions", SMALL, done)
    seconds, status, said = outcome[0]
    return small, seconds, status, said


async def _run(url: str, streams: int, seconds: float, max_tokens: int, mib: float) -> str:
    lines = [f"server {url}; client: bench.http on trio, one process; probes every {PROBE_INTERVAL * 1e3:.0f} ms"]
    if streams > 0:
        idle_health = await _probe(url, "GET", "/health", None, trio.current_time() + 3)
        health, finished = await _streams(url, streams, seconds, max_tokens)
        lines += [idle_health.line("/health, idle (the floor)"),
                  health.line(f"/health, {streams} streams x {max_tokens} tok"),
                  f"{'':<34} ({finished} streams finished in {seconds:.0f} s)"]
    if mib > 0:
        idle_small = await _probe(url, "POST", "/v1/completions", SMALL, trio.current_time() + 3)
        small, refusal, status, said = await _huge_prompt(url, mib)
        lines += [idle_small.line("small completion, idle (the floor)"),
                  small.line(f"small completion, {mib:g} MiB prompt"),
                  f"{'':<34} (the {mib:g} MiB prompt: HTTP {status} in {refusal:.2f} s: {said})"]
        small, served, status, _ = await _huge_prompt(url, mib, truncate_prompt_tokens=8)
        lines += [small.line(f"small completion, {mib:g} MiB cut to 8"),
                  f"{'':<34} (the {mib:g} MiB prompt with truncate_prompt_tokens 8: HTTP {status} in {served:.2f} s)"]
    return "\n".join(lines)


def run(url: str, streams: int, seconds: float, max_tokens: int, huge_prompt_mib: float) -> str:
    return trio.run(_run, url, streams, seconds, max_tokens, huge_prompt_mib)
