"""Serving while the graphs compile (engine/core/background_compile.py): who asks for it, what
the child is given, and what a child that fails or outlives its welcome leaves. The whole path,
a real child compiling real graphs, is tests/test_compiled_decode.py's
`test_a_first_start_serves_on_the_eager_model_while_a_child_compiles_then_on_the_graphs`."""

from __future__ import annotations

import os
import pickle
import sys

import anyio
import trio

from engine import open_engine
from engine.core.background_compile import compile_in_background, run_child
from engine.cpu_binding import CpuLayout
from engine.worker.compile_child import CompileJob
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


def test_serve_compiles_in_the_background_and_generate_and_the_library_do_not():
    from web.cli import _parser
    from web.options import engine_config as cli_config

    assert cli_config("m", _parser().parse_args(["serve", "m"])).compile_in_background is True
    off = _parser().parse_args(["serve", "m", "--no-compile-in-background"])
    assert cli_config("m", off).compile_in_background is False
    # `generate` exits once it has its answers: a child compiling then would be killed, unsaved.
    assert cli_config("m", _parser().parse_args(["generate", "hi", "--model", "m"])).compile_in_background is False
    assert engine_config("m").compile_in_background is False


async def test_an_eager_engine_defers_nothing_and_its_graphs_are_settled_at_once(tiny_model_dir):
    """Nothing to compile (enforce_eager, the tests' default): no child, `graphs_settled` set."""
    async with open_engine(engine_config(tiny_model_dir, compile_in_background=True)) as engine:
        assert engine.core.graphs_settled.is_set()
        assert engine.core.executor.worker.background_compile_job() is None
        done = await final_output(engine, [5, 6, 7], greedy(3))
    assert len(done.outputs[0].token_ids) == 3


class FailingExecutor:
    """Stands in for the executor when the child fails: adoption must never be asked for."""

    async def collective_rpc(self, method, *args, **kwargs):
        raise AssertionError(f"{method} called after the child failed")


async def test_a_child_that_fails_leaves_steps_eager_and_settles(monkeypatch, caplog):
    job = CompileJob(engine_config("m"), 8)
    monkeypatch.setattr(CompileJob, "command", staticmethod(lambda: [sys.executable, "-c", "raise SystemExit(3)"]))
    settled = anyio.Event()
    await compile_in_background(job, FailingExecutor(), settled)
    assert settled.is_set()
    assert "failed (exit code 3" in caplog.text and "steps stay on the eager model" in caplog.text


async def test_cancelling_the_compile_kills_the_child_and_what_it_started(tmp_path):
    """The engine stopping mid-compile: the child and its own children (the C++ compilers) are
    killed, and the call returns once the child is reaped."""
    pids = tmp_path / "pids"
    os.mkfifo(pids)
    script = ("import os, subprocess, sys, time\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"with open({str(pids)!r}, 'w') as f:\n"
              "    f.write(f'{os.getpid()} {g.pid}')\n"
              "time.sleep(600)\n")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_child, [sys.executable, "-c", script], b"")
        child, grandchild = map(int, (await trio.to_thread.run_sync(pids.read_text)).split())
        exits = [os.pidfd_open(pid) for pid in (child, grandchild)]
        nursery.cancel_scope.cancel()
    try:
        with trio.fail_after(30):  # a bound for a broken kill, not a wait: both are dead by now or soon
            for fd in exits:
                await trio.lowlevel.wait_readable(fd)  # readable once the process has exited
    finally:
        for fd in exits:
            os.close(fd)


def test_the_childs_job_computes_on_the_event_loops_cpus_and_compiles_there_before_serving():
    """The child's steps would take the CPUs the engine's steps run on: it gets the event
    loop's, which a step leaves idle; it compiles in the foreground, on fixed threads."""
    import torch

    from engine.worker.worker import DeferredGraphs, Worker

    threads = torch.get_num_threads()
    try:
        worker = Worker(engine_config("m", cpu_layout=CpuLayout((1,), (0,), borrow=(0,)), compile_in_background=True))
    finally:
        torch.set_num_threads(threads)
    assert worker.background_compile_job() is None  # nothing deferred
    worker.deferred_graphs = DeferredGraphs(decode=None, step=None, num_blocks=8)  # type: ignore[arg-type]
    job = worker.background_compile_job()
    assert job is not None and pickle.loads(pickle.dumps(job)) == job  # it crosses a pipe
    assert job.num_blocks == 8 and job.config.cpu_layout == CpuLayout((0,), (0,))
    assert (job.config.compile_in_background, job.config.adaptive_cpu_threads) == (False, False)
    assert job.command()[-2:] == ["--parent-pid", str(os.getpid())]
