"""The forward pass runs in a worker thread: while it computes, the event loop keeps serving."""

from __future__ import annotations

import threading
from functools import partial

import trio
import trio.testing

from engine import open_engine
from engine.concurrency.loop_lag import run_loop_lag_probe
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


async def test_a_long_waiting_queue_never_stalls_the_loop(tiny_model_dir):
    """80 streams against 8 running slots (72 waiting, no queue bound): the longest the event loop
    ever went without running a waiting task stays far under a second. (An overloaded server
    answered /health in 2 s once; a loop held that long by the scheduler, the output path or the
    server shows here: the engine core runs on this loop too.) Bounded at 1 s, ten times the
    target, so that a busy machine does not fail it; docs/benchmarks.md has the measured figures."""
    from bench.http import request
    from tests.server_fixtures import running_server

    config = engine_config(tiny_model_dir, max_num_seqs=8)
    async with running_server(config) as server:
        lags: list[float] = []

        async def stream():
            body = {"prompt": "hello there", "max_tokens": 24, "ignore_eos": True, "stream": True}
            response = await request(server.url, "POST", "/v1/completions", body)
            assert response.status == 200 and response.body.endswith(b"data: [DONE]\n\n")

        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_loop_lag_probe, lags.append, 0.005))  # the server's own probe
            async with trio.open_nursery() as clients:
                for _ in range(80):
                    clients.start_soon(stream)
            nursery.cancel_scope.cancel()
        stats = server.engine.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert lags and max(lags) < 1.0, f"the loop stalled for {max(lags):.2f} s"


async def test_the_loop_runs_while_a_long_prompt_is_tokenized(tiny_model_dir):
    """The tokenizers library's `encode` holds the GIL for the whole call: tokenizing a 15 MiB
    prompt in a worker thread stopped the event loop for 13 s (every request waited, /health too).
    Long texts go through its `encode_batch`, which releases it: the loop keeps turning meanwhile.
    With the GIL held, the loop's longest pause is the whole tokenization; here it is a fraction of
    it (the ids' conversion to a Python list holds the GIL briefly)."""
    import time

    from engine.render.tokenizer import GIL_FREE_CHARS, Tokenizer

    tokenizer = Tokenizer(tiny_model_dir)
    text = "hello world the engine says " * 40_000  # ~1.1 MB: about a second of tokenizing
    assert len(text) >= GIL_FREE_CHARS
    done = trio.Event()
    took = 0.0

    def tokenize():
        nonlocal took
        start = time.perf_counter()
        ids = tokenizer.encode(text)
        took = time.perf_counter() - start
        return ids

    tokens: list[list[int]] = []

    async def run():
        tokens.append(await trio.to_thread.run_sync(tokenize))
        done.set()

    longest = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        while not done.is_set():
            before = time.perf_counter()
            await trio.lowlevel.checkpoint()
            longest = max(longest, time.perf_counter() - before)
    assert longest < took / 2, f"the loop paused {longest:.2f} s of a {took:.2f} s tokenization"
    assert tokens == [tokenizer.backend.encode(text).ids]  # the same tokens as the one-text call
