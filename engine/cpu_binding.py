"""`--cpu-threads-bind`: which CPUs run the forward pass and which the event loop (vLLM-CPU's
`VLLM_CPU_OMP_THREADS_BIND`).

On a small machine the HTTP server, the scheduler and the model's intra-op threads compete for
the same cores; vLLM-CPU reserves one CPU for its API server and binds its compute threads to
the rest. `auto` does that here (on one CPU nothing is bound), and lends the reserved CPU to the
forward pass whenever steps measure faster with it (`CpuLayout.borrow`), `none` binds nothing and leaves
torch its default thread count, and a list (`"1"`, `"0-2,5"`) names the compute CPUs; the event
loop gets the others (all of them when the list takes every CPU).

Linux affinity is per thread: the compute thread binds itself for the duration of each
forward-pass call (`bound_to`), so a thread of a shared pool never keeps the compute CPUs
after; the event loop's thread binds once at start-up, and threads it starts later inherit that.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuLayout:
    """Which CPUs compute and which serve.

    `borrow`: server CPUs a step may also compute on, one more intra-op thread for each, when
    the thread tuner (engine/worker/thread_tuner.py) measures steps faster so. A model step that
    takes tens of milliseconds leaves the HTTP server's CPU idle for most of it (it formats a few
    hundred bytes a token); when the server is busy, or a neighbour is, the probe loses and the
    step stays on `compute` alone, the quiet layout."""

    compute: tuple[int, ...]  # CPUs of the forward pass; torch uses one intra-op thread per CPU
    server: tuple[int, ...]  # CPUs of the event loop (HTTP, scheduler, rendering threads)
    borrow: tuple[int, ...] = ()  # server CPUs the forward pass may take while that measures faster

    def describe(self) -> str:
        return f"compute threads on CPUs {_ranges(self.compute)}, event loop on CPUs {_ranges(self.server)}"

    @property
    def most_threads(self) -> int:
        """The most intra-op threads a step may run: one per compute CPU and per borrowable one."""
        return len(self.compute) + len(self.borrow)

    def server_binding(self, lends: bool) -> tuple[int, ...] | None:
        """The CPUs to bind the HTTP server's process to (None: leave it unbound). When the
        forward pass may borrow the server's CPUs (`lends`: the thread tuner is on), the server
        stays unbound: bound to the lent CPU, each token's few hundred microseconds of HTTP work
        preempted the OpenMP thread there, and the whole team waited at its next barrier. On the
        0.5B Q8_0 file at one stream, two threads took 0.86-0.93x the time of one with the server
        bound, 0.57-0.63x unbound (ITL 74-79 against 47-53 ms; docs/benchmarks.md). Unbound, the
        kernel's scheduler wakes the server on whichever CPU is idle."""
        if lends and self.borrow:
            return None
        return self.server

    def cpus_for(self, threads: int) -> tuple[int, ...]:
        """The CPUs of a step on `threads` intra-op threads: the compute CPUs, and one borrowed
        CPU for each thread beyond them."""
        return self.compute + self.borrow[:max(0, threads - len(self.compute))]


def available_cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpu_threads_bind(value: str, available: Sequence[int]) -> CpuLayout | None:
    """The layout `value` asks for on the CPUs `available` (None: bind nothing). A bad value or a
    CPU outside `available` is a ValueError naming it."""
    value = value.strip()
    if value == "none":
        return None
    if value == "auto":
        if len(available) < 2:
            return None
        return CpuLayout(tuple(available[1:]), tuple(available[:1]), borrow=tuple(available[:1]))
    compute = _parse_list(value)
    outside = sorted(set(compute) - set(available))
    if outside:
        raise ValueError(f"--cpu-threads-bind names CPUs {_ranges(outside)}, which this process may not use "
                         f"(it may use {_ranges(available)})")
    rest = tuple(c for c in available if c not in compute)
    return CpuLayout(compute, rest or compute)


def _parse_list(value: str) -> tuple[int, ...]:
    cpus: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError(part)
            cpus += range(low, high + 1)
    except ValueError:
        raise ValueError(f"--cpu-threads-bind takes auto, none or a CPU list such as 1 or 0-2,5; got {value!r}") \
            from None
    return tuple(sorted(set(cpus)))


def _ranges(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def bind_this_thread(cpus: Sequence[int]) -> None:
    os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux affinity is per thread)


@contextmanager
def bound_to(cpus: Sequence[int] | None) -> Iterator[None]:
    """Run the block on `cpus` (None: wherever it runs now), then restore the thread's CPUs."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    bind_this_thread(cpus)
    try:
        yield
    finally:
        bind_this_thread(tuple(before))


def split_layout(layout: CpuLayout | None, parts: int) -> list[CpuLayout | None]:
    """`layout`'s compute CPUs in `parts` contiguous groups, as even as they go (the server CPUs
    unchanged); with fewer CPUs than parts, part i takes CPU i modulo their number. For processes
    that share the compute CPUs: data-parallel engines, the ranks of one engine. Parts never
    borrow the server's CPUs: a step's thread count is chosen per process, and two processes that
    each measured the borrowed CPU as free would both take it."""
    if layout is None or parts == 1:
        return [layout] * parts
    cpus = layout.compute
    if len(cpus) < parts:
        return [CpuLayout((cpus[i % len(cpus)],), layout.server) for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    groups: list[CpuLayout | None] = []
    start = 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(CpuLayout(cpus[start:end], layout.server))
        start = end
    return groups
