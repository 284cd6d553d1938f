"""`trio-llm bench rpc`: the cost of the multi-process executor's RPC, against the floor.

- floor: a bare ping-pong between two processes over the same transport (a
  Unix socketpair), blocking sockets, no framework, no pickling;
- `collective_rpc("ping")` through `MultiprocExecutor` to 1 and 2 workers;
- per engine step: the same decode steps through the in-process executor
  and the multi-process one (tensor parallel size 1), on the given model.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import pairwise

import anyio

from engine.config import EngineConfig

_ECHO = "import socket,sys\ns=socket.socket(fileno=int(sys.argv[1]))\nwhile (d:=s.recv(64)): s.sendall(d)"


@dataclass
class Timing:
    name: str
    samples: list[float]

    def line(self) -> str:
        ordered = sorted(self.samples)
        p50, p99 = ordered[len(ordered) // 2], ordered[int(0.99 * (len(ordered) - 1))]
        mean = sum(ordered) / len(ordered)
        return f"{self.name:<42} {p50 * 1e6:9.1f} {p99 * 1e6:9.1f} {mean * 1e6:9.1f}"


def socket_floor(rounds: int) -> Timing:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    try:
        samples = []
        for _ in range(rounds + 100):
            start = time.perf_counter()
            ours.sendall(b"x" * 32)
            ours.recv(64)
            samples.append(time.perf_counter() - start)
        return Timing("bare socketpair ping-pong (floor)", samples[100:])
    finally:
        ours.close()
        child.wait()


async def rpc_round_trips(config: EngineConfig, rounds: int) -> Timing:
    from engine.executor.multiproc import MultiprocExecutor
    async with MultiprocExecutor(config) as executor:
        samples = []
        for _ in range(rounds + 100):
            start = time.perf_counter()
            await executor.collective_rpc("ping")
            samples.append(time.perf_counter() - start)
    return Timing(f"collective_rpc('ping'), {config.tensor_parallel_size} worker(s)", samples[100:])


async def step_times(config: EngineConfig, batch: int, steps: int) -> Timing:
    """Wall time per engine step while `batch` requests decode (the first steps, the prefills, dropped).

    Measured through the public API: every request gets one output per step, so
    the gaps between one request's outputs are the engine's step times."""
    from engine.api import SamplingParams, open_engine
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)
    arrivals: list[float] = []
    async with open_engine(config) as engine:
        async def one(i: int) -> None:
            async for _ in engine.generate([1 + i, 2, 3, 4], params):
                if i == 0:
                    arrivals.append(time.perf_counter())

        async with anyio.create_task_group() as tg:
            for i in range(batch):
                tg.start_soon(one, i)
    samples = [b - a for a, b in pairwise(arrivals)]
    return Timing(f"engine step, batch {batch}, {config.executor_kind}", samples[4:-4])


async def run(model: str, rounds: int, batch: int, steps: int) -> list[Timing]:
    results = [await anyio.to_thread.run_sync(socket_floor, rounds)]
    for size in (1, 2):
        results.append(await rpc_round_trips(EngineConfig(model=model, tensor_parallel_size=size, executor="mp"),
                                             rounds))
    for executor in ("inproc", "mp", "inproc", "mp"):  # interleaved: the machine's noise hits both
        results.append(await step_times(EngineConfig(model=model, executor=executor), batch, steps))
    return results


def report(results: list[Timing]) -> str:
    lines = [f"{'':<42} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}"] + [r.line() for r in results]
    floor = sorted(results[0].samples)[len(results[0].samples) // 2]
    for r in results[1:3]:
        lines.append(f"{r.name}: p50 {sorted(r.samples)[len(r.samples) // 2] / floor:.2f}x the floor (target <= 2)")
    return "\n".join(lines)
