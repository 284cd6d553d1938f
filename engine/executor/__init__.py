"""Executors run the Worker somewhere and expose it to the engine core as awaitables."""

from engine.executor.base import Executor
from engine.executor.inproc import InProcExecutor

__all__ = ["Executor", "InProcExecutor", "create_executor"]


def create_executor(config) -> Executor:
    if config.executor_kind == "inproc":
        return InProcExecutor(config)
    from engine.executor.multiproc import MultiprocExecutor
    return MultiprocExecutor(config)
