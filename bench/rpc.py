"""`trio-llm bench rpc`: the cost of the multi-process executor's RPC, against the floor.

- floor: a bare ping-pong between two processes over the same transport (a
  Unix socketpair), blocking sockets, no framework, no pickling;
- `collective_rpc("ping")` through `MultiprocExecutor` to 1 and 2 workers;
- per engine step: the same decode steps through the in-process executor
  and the multi-process one (tensor parallel size 1), on the given model.

With `--ray`, on a local Ray cluster of two nodes (`ray.cluster_utils.Cluster`,
this process its driver): `collective_rpc("ping")` through `RayExecutor`
beside `MultiprocExecutor` at 1 and 2 workers, in alternating rounds (median
of the rounds' p50s), and a Ray actor method called and awaited per call
through its ObjectRef (`engine.executor.ray_refs`): the transport the Ray
executor does not use for calls (docs/decisions.md).
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import anyio

from engine.config import EngineConfig, usable_cpus

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
    from engine.executor import create_executor
    async with create_executor(config) as executor:
        samples = []
        for _ in range(rounds + 100):
            start = time.perf_counter()
            await executor.collective_rpc("ping")
            samples.append(time.perf_counter() - start)
    backend = "" if config.executor_kind == "mp" else f" {config.executor_kind}"
    return Timing(f"collective_rpc('ping'){backend}, {config.tensor_parallel_size} worker(s)", samples[100:])


class _Echo:
    def ping(self) -> str:
        return "pong"


async def actor_call_round_trips(rounds: int) -> Timing:
    """A Ray actor method per call, awaited through its ObjectRef: the path `RayExecutor` does not
    take for calls."""
    import ray

    from engine.executor import ray_refs
    actor: Any = ray.remote(num_cpus=0)(_Echo).remote()
    try:
        samples = []
        for _ in range(rounds + 100):
            start = time.perf_counter()
            await ray_refs.get(actor.ping.remote())
            samples.append(time.perf_counter() - start)
    finally:
        ray.kill(actor)
    return Timing("Ray actor call (ObjectRef awaited)", samples[100:])


async def run_ray(model: str, rounds: int, repeats: int) -> tuple[list[Timing], str]:
    """`repeats` alternating rounds of mp and ray at 1 and 2 workers (the order flips each round),
    and the actor-call path, on a local two-node Ray cluster; the table and the ratios."""
    import ray
    from ray.cluster_utils import Cluster
    cpus = usable_cpus()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    cluster.add_node(num_cpus=cpus)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        results: list[Timing] = []
        for round_ in range(repeats):
            for size in (1, 2):
                order = ("mp", "ray") if round_ % 2 == 0 else ("ray", "mp")
                for backend in order:
                    config = EngineConfig(model=model, tensor_parallel_size=size, executor=backend)
                    results.append(await rpc_round_trips(config, rounds))
            results.append(await actor_call_round_trips(rounds))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return results, ray_report(results, cpus)


def _p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def ray_report(results: list[Timing], cpus: int) -> str:
    by_name: dict[str, list[float]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(_p50(r.samples))
    lines = [f"Ray cluster: 2 nodes of {cpus} CPUs on this machine (loopback); every worker gets {cpus} // workers "
             "torch threads under both executors",
             f"{'':<46} {'p50 us per round':>28} {'median':>9}"]
    for name, p50s in by_name.items():
        rounds = ", ".join(f"{p * 1e6:.1f}" for p in p50s)
        lines.append(f"{name:<46} {rounds:>28} {statistics.median(p50s) * 1e6:9.1f}")
    for size in (1, 2):
        mp = statistics.median(by_name[f"collective_rpc('ping'), {size} worker(s)"])
        ray_ = statistics.median(by_name[f"collective_rpc('ping') ray, {size} worker(s)"])
        lines.append(f"{size} worker(s): ray / mp p50 = {ray_ / mp:.2f}x (target <= 3)")
    actor = statistics.median(by_name["Ray actor call (ObjectRef awaited)"])
    mp1 = statistics.median(by_name["collective_rpc('ping'), 1 worker(s)"])
    lines.append(f"Ray actor call / mp, 1 worker: {actor / mp1:.2f}x")
    return "\n".join(lines)


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
