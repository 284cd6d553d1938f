"""Serving while the graphs compile (`EngineConfig.compile_in_background`).

A first start of a model compiles its decode and step graphs: minutes on a small machine (the
Qwen2.5-0.5B shape's Q8_0 file took 264 s and 182 s on 2 cores). With this, the engine is healthy
as soon as the model is loaded: steps run on the eager model while a child process
(engine/worker/compile_child.py) compiles and saves the graphs, and the worker then loads them
between two steps (`Worker.adopt_compiled_graphs`), through the executor like any other call,
so no step runs while the graphs change. Later starts load the saved graphs before serving, as
they always did.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
from contextlib import suppress

import anyio

from engine.executor.base import Executor
from engine.ipc.process import describe_exit
from engine.worker.compile_child import CompileJob

logger = logging.getLogger(__name__)


async def compile_in_background(job: CompileJob, executor: Executor, settled: anyio.Event) -> None:
    """Run `job` in a child process, then have the worker adopt the graphs it saved; `settled`
    is set once steps run on them, or once they will not (the child failed: logged, and steps stay
    eager).

    Cancellation (the engine stopping) kills the child and the compilers it started, and returns
    once they are gone."""
    started = anyio.current_time()
    try:
        code = await run_child(job.command(), pickle.dumps(job))
        if code != 0:
            logger.warning("compiling the graphs in a child process failed (%s; its log is above); steps stay on "
                           "the eager model", describe_exit(code))
            return
        try:
            adopted = await executor.collective_rpc("adopt_compiled_graphs", unique_reply_rank=0)
        except Exception:  # a compiled graph is a speed-up: failing to adopt one must not stop serving
            logger.exception("the compiled graphs could not be adopted; steps stay on the eager model")
            return
        if adopted:
            logger.info("steps run on the compiled graphs from now on (compiled in the background in %.0f s)",
                        anyio.current_time() - started)
    finally:
        settled.set()


async def run_child(command: list[str], stdin: bytes) -> int:
    """Run `command` with `stdin` as its input, its output on ours; its exit status.

    Cancellation kills its whole process group (the C++ compilers it runs too), then waits for it."""
    async with await anyio.open_process(command, stdin=subprocess.PIPE, stdout=None, stderr=None,
                                        start_new_session=True) as process:
        try:
            assert process.stdin is not None
            await process.stdin.send(stdin)
            await process.stdin.aclose()
            return await process.wait()
        except BaseException:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise
