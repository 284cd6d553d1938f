"""--cpu-threads-bind: parsing the layout, and the forward pass running on its CPUs only."""

from __future__ import annotations

import os

import pytest
import torch

from engine import open_engine
from engine.cpu_binding import CpuLayout, bound_to, parse_cpu_threads_bind
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


def test_auto_keeps_the_first_cpu_for_the_event_loop():
    assert parse_cpu_threads_bind("auto", (0, 1)) == CpuLayout(compute=(1,), server=(0,))
    assert parse_cpu_threads_bind("auto", (2, 3, 4, 5)) == CpuLayout(compute=(3, 4, 5), server=(2,))
    assert parse_cpu_threads_bind("auto", (0,)) is None  # one CPU: nothing to separate
    assert parse_cpu_threads_bind("none", (0, 1)) is None


def test_a_list_names_the_compute_cpus_and_the_loop_gets_the_rest():
    assert parse_cpu_threads_bind("1", (0, 1, 2)) == CpuLayout(compute=(1,), server=(0, 2))
    assert parse_cpu_threads_bind("0-1,3", (0, 1, 2, 3)) == CpuLayout(compute=(0, 1, 3), server=(2,))
    assert parse_cpu_threads_bind("0-1", (0, 1)) == CpuLayout(compute=(0, 1), server=(0, 1))  # all: shared
    for bad in ("x", "2-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="auto, none or a CPU list"):
            parse_cpu_threads_bind(bad, (0, 1, 2))
    with pytest.raises(ValueError, match="CPUs 7, which this process may not use"):
        parse_cpu_threads_bind("0,7", (0, 1))


def test_bound_to_restores_the_threads_cpus():
    before = os.sched_getaffinity(0)
    one = min(before)
    with bound_to((one,)):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == before
    with bound_to(None):
        assert os.sched_getaffinity(0) == before


async def test_the_forward_pass_runs_on_the_compute_cpus_only(tiny_model_dir):
    cpus = sorted(os.sched_getaffinity(0))
    layout = CpuLayout(compute=(cpus[-1],), server=tuple(cpus[:-1]) or (cpus[-1],))
    threads = torch.get_num_threads()
    seen: list[set[int]] = []
    try:
        async with open_engine(engine_config(tiny_model_dir, cpu_layout=layout)) as engine:
            runner = engine.core.executor.worker.runner
            execute = runner.execute
            runner.execute = lambda sched_out: (seen.append(os.sched_getaffinity(0)), execute(sched_out))[1]
            assert torch.get_num_threads() == 1
            done = await final_output(engine, [5, 6, 7], greedy(3))
        assert len(done.outputs[0].token_ids) == 3
    finally:
        torch.set_num_threads(threads)
    assert seen and all(affinity == {cpus[-1]} for affinity in seen)
    assert os.sched_getaffinity(0) == set(cpus)  # the test's own thread was never bound
