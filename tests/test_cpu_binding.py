"""--cpu-threads-bind: parsing the layout, and the forward pass running on its CPUs only."""

from __future__ import annotations

import os

import pytest
import torch

from engine import open_engine
from engine.cpu_binding import CpuLayout, bound_to, parse_cpu_threads_bind, split_layout
from engine.worker.thread_tuner import ThreadTuner
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


def test_auto_keeps_the_first_cpu_for_the_event_loop_and_may_lend_it():
    assert parse_cpu_threads_bind("auto", (0, 1)) == CpuLayout(compute=(1,), server=(0,), borrow=(0,))
    assert parse_cpu_threads_bind("auto", (2, 3, 4, 5)) == CpuLayout(compute=(3, 4, 5), server=(2,), borrow=(2,))
    assert parse_cpu_threads_bind("auto", (0,)) is None  # one CPU: nothing to separate
    assert parse_cpu_threads_bind("none", (0, 1)) is None


def test_the_server_stays_unbound_only_while_its_cpus_may_be_lent():
    lent = CpuLayout(compute=(1,), server=(0,), borrow=(0,))
    assert lent.server_binding(lends=True) is None
    assert lent.server_binding(lends=False) == (0,)  # --no-adaptive-cpu-threads: the quiet layout
    assert CpuLayout(compute=(1,), server=(0, 2)).server_binding(lends=True) == (0, 2)  # a list lends nothing


def test_a_list_names_the_compute_cpus_and_the_loop_gets_the_rest():
    assert parse_cpu_threads_bind("1", (0, 1, 2)) == CpuLayout(compute=(1,), server=(0, 2))
    assert parse_cpu_threads_bind("0-1,3", (0, 1, 2, 3)) == CpuLayout(compute=(0, 1, 3), server=(2,))
    assert parse_cpu_threads_bind("0-1", (0, 1)) == CpuLayout(compute=(0, 1), server=(0, 1))  # all: shared
    for bad in ("x", "2-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="auto, none or a CPU list"):
            parse_cpu_threads_bind(bad, (0, 1, 2))
    with pytest.raises(ValueError, match="CPUs 7, which this process may not use"):
        parse_cpu_threads_bind("0,7", (0, 1))


def test_a_step_borrows_a_server_cpu_only_for_a_thread_beyond_the_compute_cpus():
    layout = parse_cpu_threads_bind("auto", (0, 1, 2))
    assert layout is not None and layout.most_threads == 3
    assert [layout.cpus_for(threads) for threads in (1, 2, 3)] == [(1, 2), (1, 2), (1, 2, 0)]
    listed = parse_cpu_threads_bind("1", (0, 1))
    assert listed is not None and listed.most_threads == 1 and listed.cpus_for(2) == (1,)
    # Processes that share the compute CPUs never borrow (each would count the CPU as free).
    assert [part.borrow for part in split_layout(layout, 2) if part is not None] == [(), ()]
    assert split_layout(layout, 1) == [layout]


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
            runner.execute = lambda sched_out, on_step=None: (seen.append(os.sched_getaffinity(0)),
                                                              execute(sched_out, on_step))[1]
            assert torch.get_num_threads() == 1
            done = await final_output(engine, [5, 6, 7], greedy(3))
        assert len(done.outputs[0].token_ids) == 3
    finally:
        torch.set_num_threads(threads)
    assert seen and all(affinity == {cpus[-1]} for affinity in seen)
    assert os.sched_getaffinity(0) == set(cpus)  # the test's own thread was never bound


class ScriptedTuner(ThreadTuner):
    """The counts a test names, in turn (the real tuner picks from measured step times)."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(max(counts), start=counts[0])
        self.counts = counts

    def next_threads(self) -> int:
        return self.counts[self.steps % len(self.counts)]


async def test_a_step_on_a_borrowed_cpu_runs_there_and_the_next_gives_it_back(tiny_model_dir):
    """With the tuner on two threads, the step runs on the compute CPU and the server's; on one,
    on the compute CPU alone."""
    cpus = sorted(os.sched_getaffinity(0))
    layout = CpuLayout(compute=(cpus[-1],), server=(cpus[0],), borrow=(cpus[0],))
    threads = torch.get_num_threads()
    seen: list[tuple[set[int], int]] = []
    try:
        # One decode a step: the four tokens' steps alternate between the scripted counts.
        async with open_engine(engine_config(tiny_model_dir, cpu_layout=layout, num_scheduler_steps=1)) as engine:
            worker = engine.core.executor.worker
            worker.thread_tuner = ScriptedTuner([1, 2])
            runner = worker.runner
            execute = runner.execute
            runner.execute = lambda sched_out, on_step=None: (
                seen.append((os.sched_getaffinity(0), torch.get_num_threads())), execute(sched_out, on_step))[1]
            done = await final_output(engine, [5, 6, 7], greedy(4))
        assert len(done.outputs[0].token_ids) == 4
    finally:
        torch.set_num_threads(threads)
    assert seen == [({cpus[-1]}, 1), ({cpus[-1], cpus[0]}, 2)] * 2


async def test_a_model_loads_on_every_cpu_the_layout_lends_then_steps_start_on_the_compute_cpus(tiny_model_dir,
                                                                                                 monkeypatch):
    """Nothing is served while the weights load: the lent CPU (the loop's) loads with the compute
    CPU, one torch thread each; then the worker is back on the compute CPU's one thread."""
    from engine.worker import worker as worker_module
    cpus = sorted(os.sched_getaffinity(0))
    layout = CpuLayout(compute=(cpus[-1],), server=(cpus[0],), borrow=(cpus[0],))
    seen: list[tuple[set[int], int]] = []
    real_load = worker_module.load_decoder

    def spy(*args, **kwargs):
        seen.append((os.sched_getaffinity(0), torch.get_num_threads()))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(worker_module, "load_decoder", spy)
    threads = torch.get_num_threads()
    try:
        async with open_engine(engine_config(tiny_model_dir, cpu_layout=layout)) as engine:
            assert seen == [({cpus[-1], cpus[0]}, 2)]
            assert torch.get_num_threads() == 1  # the compute CPU's thread, as before the load
            done = await final_output(engine, [5, 6, 7], greedy(4))
            assert len(done.outputs[0].token_ids) == 4
    finally:
        torch.set_num_threads(threads)
