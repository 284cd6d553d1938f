"""Part of `trio-llm bench loop-lag`: what parsing one prompt_embeds request body costs the loop.

The body is parsed in a worker thread in both cases, as the server does;
what matters is how long the GIL is held, because that is how long the loop
can be stalled. Measured with the loop-lag probe (1 ms sleeps) on this trio
loop while a worker thread parses the body `repeats` times, for the ordinary
parse (pydantic-core builds the payload string) and for the view path
(`web.http.embeds_body`).
"""

from __future__ import annotations

import base64
import io
import json
import time

import anyio
import torch

from engine.concurrency.loop_lag import run_loop_lag_probe
from web.http.bodies import parse_body
from web.openai.protocol import CompletionRequest


def _body(rows: int, hidden: int) -> bytearray:
    buffer = io.BytesIO()
    torch.save(torch.randn(rows, hidden).to(torch.bfloat16), buffer)
    payload = base64.b64encode(buffer.getvalue()).decode()
    return bytearray(json.dumps({"prompt_embeds": payload, "max_tokens": 4}).encode())


async def _parse_while_probing(body: bytearray, repeats: int, split_embeds_bytes: int) -> tuple[float, float]:
    """(median parse seconds, max loop lag meanwhile)"""
    durations: list[float] = []
    lags: list[float] = [0.0]

    def parse_all() -> None:
        for _ in range(repeats):
            start = time.perf_counter()
            parse_body(CompletionRequest, body, split_embeds_bytes=split_embeds_bytes)
            durations.append(time.perf_counter() - start)

    async with anyio.create_task_group() as tg:
        await tg.start(run_loop_lag_probe, lags.append, 0.001)
        await anyio.to_thread.run_sync(parse_all)
        tg.cancel_scope.cancel()
    return sorted(durations)[len(durations) // 2], max(lags)


async def run(rows: int, hidden: int, repeats: int = 5) -> str:
    body = _body(rows, hidden)
    ordinary = await _parse_while_probing(body, repeats, split_embeds_bytes=len(body) + 1)
    views = await _parse_while_probing(body, repeats, split_embeds_bytes=0)
    return "\n".join([
        f"HTTP body with one {rows}x{hidden} bfloat16 payload ({len(body) / 1e6:.1f} MB), parsed in a thread:",
        f"  ordinary JSON parse   {ordinary[0] * 1e3:7.2f} ms each, loop stalled up to {ordinary[1] * 1e3:6.2f} ms",
        f"  payloads as views     {views[0] * 1e3:7.2f} ms each, loop stalled up to {views[1] * 1e3:6.2f} ms",
    ])
