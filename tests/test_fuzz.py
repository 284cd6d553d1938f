"""Hypothesis fuzzes every endpoint of a real server process: no 5xx, and it keeps serving.

The server runs as `trio-llm serve` in a child process, as users run it, with
small limits so that a hostile but valid request (n up to max_num_seqs,
max_tokens up to the context) stays cheap. `trio-llm bench fuzz` is the long run.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from bench import fuzz, keepalive
from tests.helpers import log_until

MAX_MODEL_LEN = 64
API_KEY = "fuzz-key"
MAX_BODY_BYTES = 1 << 20


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    port = _free_port()
    command = [sys.executable, "-m", "web.cli", "serve", tiny_model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-embeds",
               "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES), "--log-level", "info"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log_until(process, "Serving on")
        assert process.stderr is not None
        # Keep draining the log so the server never blocks on a full pipe.
        drain = threading.Thread(target=process.stderr.read, daemon=True)
        drain.start()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server_url):
    with httpx.Client(base_url=server_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        yield http


@settings(max_examples=300, database=None, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=fuzz.requests())
def test_no_request_gets_a_5xx(client, request: tuple[str, dict[str, Any]]):
    path, body = request
    payload = fuzz.encode(body)
    response = client.post(path, content=payload, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (path, payload[:500], response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]  # every refusal is in the error shape, naming a message
        assert error["message"]


def test_the_server_still_serves_after_the_fuzzing(client):
    assert fuzz.still_serving(client) is None


def test_every_request_on_a_kept_alive_connection_is_answered(server_url):
    """Issue 36: one pooled connection, every route, every refusal this server gives (401 with no key
    and a wrong one, 400, 404, 405, 413) mixed with 200s, streamed and not: each answered in a second."""
    report = keepalive.run(server_url, API_KEY, count=300, timeout=1.0, max_body_bytes=MAX_BODY_BYTES)
    assert not report.failures, report.summary()
    assert sum(report.statuses.values()) == 300 and {200, 400, 401, 404, 405, 413} <= set(report.statuses)
