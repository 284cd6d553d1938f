"""SIGTERM: stop accepting, let in-flight requests finish, exit 0 (a real `trio-llm serve` process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import trio

from bench.http import open_request
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from web.http.settings import ServerSettings
from web.serve import serve


async def _bound_url(stderr) -> str:
    """The server's URL, once it says it listens on every interface (no --host: vLLM's default) and
    warns that it has no --api-key."""
    seen = b""
    while not (match := re.search(rb"Serving on http://0\.0\.0\.0:(\d+).*listening on every interface", seen,
                                  flags=re.S)):
        chunk = await stderr.receive_some(4096)
        assert chunk, f"the server exited before listening: {seen.decode(errors='replace')[-2000:]}"
        seen += chunk
    return f"http://127.0.0.1:{match.group(1).decode()}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_lets_the_in_flight_stream_finish_then_exits_zero(tiny_model_dir, signum, tmp_path):
    """...and leaves no file in the temporary directory: what the server, the engine and torch
    write goes under the cache root (inductor's precompiled headers went to /tmp)."""
    command = [sys.executable, "-m", "web.cli", "--log-level", "info", "serve", tiny_model_dir, "--port", "0",
               "--kv-cache-memory-bytes", str(1 << 24), "--grace-period", "20"]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    with trio.fail_after(180):  # a first start compiles the model's graphs
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                   env=env)
        try:
            url = await _bound_url(process.stderr)
            body = {"prompt": "keep going", "max_tokens": 60, "ignore_eos": True, "stream": True}
            connection = await open_request(url, "POST", "/v1/completions", body)
            data = b""
            while b"data: " not in data:
                data += await connection.receive_some(4096)
            process.send_signal(signum)  # the stream is in flight
            while b"data: [DONE]" not in data:
                chunk = await connection.receive_some(4096)
                assert chunk, "the stream was cut before it finished"
                data += chunk
            await connection.aclose()
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    events = re.findall(rb"data: (\{.*?\})\n\n", data)
    # "length": all 60 tokens were generated and delivered although the signal came after the first.
    assert json.loads(events[-1])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
    assert sorted(p.name for p in temp.iterdir()) == []


async def test_streams_still_open_when_the_grace_period_ends_get_an_error_event_and_done(tiny_model_dir):
    stop, status = trio.Event(), []

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        status.append(await serve(engine_config(tiny_model_dir), ServerSettings(grace_period=1.0), "127.0.0.1", 0,
                                  executor=FakeExecutor(step_time=0.02), shutdown_trigger=stop.wait,
                                  log_level="error", task_status=task_status))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(run)
            body = {"prompt": "keep going", "max_tokens": 400, "ignore_eos": True, "stream": True}
            connection = await open_request(url, "POST", "/v1/completions", body)
            data = b""
            while b"data: " not in data:
                data += await connection.receive_some(4096)
            stop.set()  # as SIGTERM does; the stream would need ~8 s more, the grace period is 1 s
            while chunk := await connection.receive_some(4096):
                data += chunk
            await connection.aclose()
    events = re.findall(rb"data: (.*?)\n\n", data)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["reason"] == "server_shutting_down" and "shutting down" in error["message"]
    assert status == [0]
