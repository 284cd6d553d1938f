"""Clients that hang up abort their requests; metrics show it; a dead engine turns into 503s."""

from __future__ import annotations

import json
import random
import re

import trio

from bench.http import open_request, request
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from tests.server_fixtures import running_server


def response_complete(data: bytes) -> bool:
    """The whole response is in: the last SSE chunk, or a body as long as its Content-Length."""
    if b"data: [DONE]" in data:
        return True
    head, sep, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.I)
    return bool(sep and length and len(body) >= int(length.group(1)))


def metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


async def test_many_streams_dropped_at_random_points_leave_nothing_running(tiny_model_dir):
    rng = random.Random(7)
    async with running_server(engine_config(tiny_model_dir, num_kv_blocks=128, max_num_seqs=16)) as server:
        async def stream_then_hang_up(i: int) -> None:
            body = {"prompt": f"stream {i} " + "words " * rng.randrange(1, 30), "max_tokens": 200,
                    "ignore_eos": True, "stream": rng.random() < 0.8}
            connection = await open_request(server.url, "POST", "/v1/completions", body)
            want = rng.randrange(0, 4000)  # bytes to read before hanging up (0: right after sending)
            data = b""
            while len(data) < want and not response_complete(data):
                data += await connection.receive_some(1024)
            await connection.aclose()

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(stream_then_hang_up, i)
        engine = server.engine
        await engine.core.wait_until_idle()
        text = (await request(server.url, "GET", "/metrics")).body.decode()
        assert metric(text, "trio_llm_requests_running") == 0
        assert metric(text, "trio_llm_requests_waiting") == 0
        assert metric(text, "trio_llm_kv_cache_usage_ratio") == 0
        assert metric(text, 'trio_llm_requests_finished_total') >= 1
        assert 'finished_reason="abort"' in text
        ok = await request(server.url, "POST", "/v1/completions", {"prompt": "still there", "max_tokens": 2})
        assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 2


async def test_metrics_count_tokens_and_latencies(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as server:
        for _ in range(3):
            await request(server.url, "POST", "/v1/completions",
                          {"prompt": "count me", "max_tokens": 4, "ignore_eos": True})
        text = (await request(server.url, "GET", "/metrics")).body.decode()
        assert metric(text, "trio_llm_generation_tokens_total") == 12
        assert metric(text, "trio_llm_prompt_tokens_total") == 3 * len(server.engine.tokenizer.encode("count me"))
        assert metric(text, 'trio_llm_requests_finished_total') == 3
        assert metric(text, "trio_llm_time_to_first_token_seconds_count") == 3
        assert metric(text, "trio_llm_inter_token_latency_seconds_count") == 9
        assert metric(text, "trio_llm_e2e_request_latency_seconds_count") == 3
        assert metric(text, "trio_llm_event_loop_lag_seconds_count") >= 0


class DiesOnThirdStep(FakeExecutor):
    async def execute_model(self, sched_out):
        if len(self.steps) == 3:
            raise RuntimeError("GPU fell off the bus")
        return await super().execute_model(sched_out)


async def test_engine_death_gives_clear_errors_and_503_health(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir), executor=DiesOnThirdStep(step_time=0.001)) as server:
        assert (await request(server.url, "GET", "/health")).status == 200
        streamed = await request(server.url, "POST", "/v1/completions",
                                 {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True})
        events = streamed.body.decode().split("\n\n")
        error = json.loads(events[-3].removeprefix("data: "))
        assert "GPU fell off the bus" in error["error"]["message"] and events[-2] == "data: [DONE]"
        assert (await request(server.url, "GET", "/health")).status == 503
        later = await request(server.url, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        error = later.json()["error"]
        assert later.status == 503 and error["reason"] == "engine_dead" and error["code"] == 503
