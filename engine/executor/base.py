"""The executor interface the engine core drives.

An executor owns the worker(s). `execute_model` is awaited once per step by
the engine-core task only, so calls never overlap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import ModelInfo


class Executor(ABC):
    @abstractmethod
    async def load_model(self) -> ModelInfo:
        """Load the model on every worker; returns what the engine needs to size itself."""

    @abstractmethod
    async def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @abstractmethod
    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Cancellation waits for the step in flight to end (the worker's
        state must stay consistent), then raises."""

    async def aclose(self) -> None:
        """Release workers. Safe to call more than once."""
