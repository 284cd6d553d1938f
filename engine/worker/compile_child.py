"""`python -m engine.worker.compile_child`: compile and save a worker's graphs in a process of
its own, while the engine serves on the eager model (`EngineConfig.compile_in_background`).

The engine writes a pickled `CompileJob` to the child's stdin. The child loads the model as the
worker did and builds the same graphs over a KV cache of the same shape, so they are saved
under the names the worker looks for (engine/worker/precompiled_graph.py, `artefact_path`); the
worker then loads them in seconds (`Worker.adopt_compiled_graphs`). The child's cache is
allocated but never zeroed: the compile writes before it reads, and untouched pages cost no
memory, so the child costs a second copy of the weights for the minutes it runs, not a second
cache.

Why a process and not a thread: compiling is minutes of Python (tracing, inductor's code
generation) that would hold the GIL against every step served meanwhile, and a thread cannot be
stopped; a process is killed when the engine stops (`engine/core/background_compile.py`), and dies
with it if the engine is killed (`engine.ipc.process.die_with_parent`).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.ipc.process import die_with_parent
from engine.log_format import configure_logging

logger = logging.getLogger(__name__)

NICENESS = 10  # below the serving engine: its steps come first on a shared CPU


@dataclass(frozen=True)
class CompileJob:
    """The worker's configuration for the child (no background compile, its CPUs) and the number
    of KV blocks its cache was sized for."""

    config: EngineConfig
    num_blocks: int

    @staticmethod
    def command() -> list[str]:
        """The child's command line, from this (the engine's) process."""
        return [sys.executable, "-m", "engine.worker.compile_child", "--parent-pid", str(os.getpid())]


def run(job: CompileJob) -> None:
    """Load the model and compile (and save) its graphs as the worker would at start-up."""
    from engine.worker.worker import Worker

    worker = Worker(job.config)
    worker.zeroed_caches = False
    worker.load_model()
    worker.initialize_kv_cache(job.num_blocks)


def main(argv: list[str]) -> int:
    flag, parent_pid = argv
    if flag != "--parent-pid":
        raise SystemExit(f"usage: python -m engine.worker.compile_child --parent-pid PID < job; got {argv}")
    die_with_parent(int(parent_pid))
    os.nice(NICENESS)
    job = pickle.load(sys.stdin.buffer)
    if not isinstance(job, CompileJob):
        raise TypeError(f"expected a CompileJob on stdin, got {type(job).__name__}")
    configure_logging(logging.INFO)
    run(job)
    return 0


if __name__ == "__main__":
    # Through the module's own name: the job was pickled as engine.worker.compile_child.CompileJob,
    # which this __main__'s class is not.
    from engine.worker.compile_child import main as main_of_the_module

    sys.exit(main_of_the_module(sys.argv[1:]))
