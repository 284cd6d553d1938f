"""Executors run the Worker somewhere and expose it to the engine core as awaitables.

Importing this package loads no torch: the executors that need it load on use,
so `engine.testing.FakeExecutor` stays light.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor

__all__ = ["Executor", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config` asks for: in-process (a worker thread), worker processes, or Ray actors."""
    if config.executor_kind == "inproc":
        from engine.executor.inproc import InProcExecutor
        return InProcExecutor(config)
    if config.executor_kind == "ray":
        from engine.executor.ray_executor import RayExecutor
        return RayExecutor(config)
    from engine.executor.multiproc import MultiprocExecutor
    return MultiprocExecutor(config)
