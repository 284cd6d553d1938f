"""The forward pass runs in a worker thread: while it computes, the event loop keeps serving."""

from __future__ import annotations

import threading

import trio
import trio.testing

from engine import open_engine
from engine.executor.inproc import InProcExecutor
from engine.worker.worker import Worker
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


class GatedWorker(Worker):
    """A real worker whose forward pass waits until the test opens the gate."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = threading.Event()
        self.in_forward = threading.Event()

    def execute_model(self, sched_out):
        self.in_forward.set()
        self.gate.wait(timeout=30)  # bounded: a broken test fails instead of hanging
        return super().execute_model(sched_out)


async def test_loop_serves_other_requests_while_a_forward_pass_runs(tiny_model_dir):
    config = engine_config(tiny_model_dir)
    worker = GatedWorker(config)
    async with open_engine(config, executor=InProcExecutor(config, worker)) as engine:
        results = {}

        async def run(name, prompt):
            results[name] = await final_output(engine, prompt, greedy(3, ignore_eos=True))

        async with trio.open_nursery() as nursery:
            try:
                nursery.start_soon(run, "first", "the first request")
                # The step is in the worker thread, stuck at the gate.
                assert await trio.to_thread.run_sync(worker.in_forward.wait, 30)
                # The loop is free: a second request is validated, tokenized and queued meanwhile.
                nursery.start_soon(run, "second", "a second request")
                await trio.testing.wait_all_tasks_blocked()
                assert engine.core.num_pending_messages == 1
                assert not results
            finally:
                worker.gate.set()
        assert len(results["first"].outputs[0].token_ids) == 3
        assert len(results["second"].outputs[0].token_ids) == 3
