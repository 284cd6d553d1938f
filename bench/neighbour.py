"""`trio-llm bench neighbour`: served tok/s on a quiet machine against the same with a busy loop
pinned to one CPU, for each CPU layout (issue 31).

A server always shares its machine. For each layout a `trio-llm serve` is started on the
checkpoint and loaded with the side-by-side's streaming completions at each concurrency level,
quiet and with a neighbour (a Python busy loop bound to `busy_cpu`), in `repeats` rounds whose
order alternates (quiet first in even rounds). The table gives the median tok/s of each and the
median of the rounds' busy/quiet ratios, with their spread.

Layouts: `none` (nothing bound, every thread every step: `--no-adaptive-cpu-threads`), `auto`
(vLLM-CPU's: the first CPU left to the server, compute on the rest, fixed count), `adaptive`
(nothing bound, each step's thread count measured, engine/worker/thread_tuner.py). `serve`'s
default is `auto` with the count measured inside it; on two CPUs that is one compute thread, the
same as `auto` here.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from bench.serve import LevelResult, run_level
from bench.side_by_side import SERVED_NAME, rate, requests_for, served, trio_llm_command, warm_up

LAYOUTS = {
    "none": ["--cpu-threads-bind", "none", "--no-adaptive-cpu-threads"],
    "auto": ["--cpu-threads-bind", "auto", "--no-adaptive-cpu-threads"],
    "adaptive": ["--cpu-threads-bind", "none", "--adaptive-cpu-threads"],
}
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@dataclass
class LayoutRun:
    layout: str
    quiet: dict[int, list[LevelResult]] = field(default_factory=dict)
    busy: dict[int, list[LevelResult]] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def busy_neighbour(cpu: int | None) -> AsyncIterator[None]:
    """A busy loop on `cpu` for the duration (None: a quiet machine)."""
    if cpu is None:
        yield
        return
    process = await trio.lowlevel.open_process([sys.executable, "-c", BUSY_LOOP, str(cpu)],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def run(model: str, layouts: list[str], levels: list[int], num_requests: int, input_len: int,
              output_len: int, vocab: int, busy_cpu: int, dtype: str, repeats: int = 3, port: int = 8190) -> str:
    runs = []
    for layout in layouts:
        result = LayoutRun(layout)
        command = trio_llm_command(model, port, dtype, LAYOUTS[layout])
        async with served(layout, command, port, f"/tmp/neighbour-{layout}.log") as (url, _):
            await warm_up(url, input_len, vocab)
            for round_ in range(repeats):
                order = [None, busy_cpu] if round_ % 2 == 0 else [busy_cpu, None]
                for cpu in order:
                    async with busy_neighbour(cpu):
                        for concurrency in levels:
                            level = await run_level(url, SERVED_NAME, concurrency,
                                                    requests_for(concurrency, num_requests), input_len,
                                                    output_len, vocab, 300.0, None)
                            (result.quiet if cpu is None else result.busy).setdefault(concurrency, []).append(level)
        runs.append(result)
    head = (f"model={model} dtype={dtype} input_len={input_len} output_len={output_len} rounds={repeats}, quiet and "
            f"busy alternating; busy: a Python busy loop bound to CPU {busy_cpu} (server logs: /tmp/neighbour-*.log)")
    return head + "\n" + table(runs)


def table(runs: list[LayoutRun]) -> str:
    med = statistics.median
    lines = ["layout | streams | quiet tok/s | busy tok/s | busy / quiet (min-max)"]
    for result in runs:
        for level, quiet in result.quiet.items():
            busy = result.busy[level]
            ratios = [rate(b) / rate(q) if rate(q) else float("nan") for q, b in zip(quiet, busy, strict=True)]
            lines.append(f"{result.layout:>8} | {level:>7} | {med(map(rate, quiet)):>11.1f} | "
                         f"{med(map(rate, busy)):>10.1f} | {med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return "\n".join(lines)
