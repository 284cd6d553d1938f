"""The engine's stats observer and the loop-lag probe, in virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine import open_engine
from engine.concurrency.loop_lag import run_loop_lag_probe
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class Recorder:
    def __init__(self):
        self.ttft, self.itl, self.finished, self.queued, self.steps = [], [], [], [], []

    def on_step(self, num_tokens):
        self.steps.append(num_tokens)

    def on_scheduled(self, queue_time):
        self.queued.append(queue_time)

    def on_request_done(self, record):
        self.records = [*getattr(self, "records", []), record]

    def on_first_token(self, ttft):
        self.ttft.append(ttft)

    def on_tokens(self, itl, num_tokens):
        self.itl.append((itl, num_tokens))

    def on_finished(self, reason, e2e, prompt_tokens, generation_tokens):
        self.finished.append((reason, e2e, prompt_tokens, generation_tokens))


async def test_observer_sees_ttft_itl_and_finishes(tiny_model_dir, autojump_clock):
    recorder = Recorder()
    async with open_engine(engine_config(tiny_model_dir), executor=FakeExecutor(step_time=0.1),
                           observer=recorder) as engine:
        await final_output(engine, [1, 2, 3, 4], greedy(5, ignore_eos=True))
        with trio.move_on_after(0.25):
            await final_output(engine, [5, 6], greedy(50, ignore_eos=True))
        await engine.core.wait_until_idle()
    assert recorder.ttft == [pytest.approx(0.1), pytest.approx(0.1)]
    assert recorder.queued == [0.0, 0.0]  # each was scheduled in the step after it arrived
    first, second = recorder.records
    assert (first.finish_reason, first.prompt_tokens, first.generation_tokens) == ("length", 4, 5)
    assert first.ttft == pytest.approx(0.1) and first.e2e == pytest.approx(0.5) and first.queue_time == 0.0
    assert (first.n, first.max_tokens) == (1, 5)
    # vLLM's count: the first's prompt with its first token, its other four, the second's prompt and first
    assert recorder.steps[:6] == [5, 1, 1, 1, 1, 3]
    assert second.finish_reason == "abort" and second.request_id != first.request_id
    assert recorder.itl[:4] == [(pytest.approx(0.1), 1)] * 4
    (reason1, e2e1, prompt1, gen1), (reason2, _, prompt2, gen2) = recorder.finished
    assert (reason1, prompt1, gen1) == ("length", 4, 5) and e2e1 == pytest.approx(0.5)
    # Cancelled at 0.25 s in: two steps done, the third in flight completes before the abort applies.
    assert (reason2, prompt2, gen2) == ("abort", 2, 3)


async def test_loop_lag_probe_reads_zero_when_free_and_the_blocking_time_when_held(autojump_clock):
    lags = []
    # The sleeps below run in virtual time (autojump_clock): they are how time passes for the
    # probe, not a wait for another task; the test takes microseconds of wall time.
    async with trio.open_nursery() as nursery:
        await nursery.start(run_loop_lag_probe, lags.append, 0.05)
        await trio.sleep(0.2)
        assert lags and all(lag == pytest.approx(0.0, abs=1e-9) for lag in lags)
        lags.clear()
        # Hold the loop: advance the clock without yielding, as a blocking call would.
        await trio.sleep(0.01)
        autojump_clock.jump(0.3)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert max(lags) == pytest.approx(0.3 - 0.04)


class LagRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.lags = []

    def on_loop_lag(self, lag):
        self.lags.append(lag)


async def test_stats_snapshot_reports_the_batch_the_cache_the_probe_and_the_workers(tiny_model_dir, autojump_clock):
    recorder = LagRecorder()
    config = engine_config(tiny_model_dir, max_num_seqs=1, loop_lag_interval=0.05)
    async with open_engine(config, executor=FakeExecutor(step_time=0.1), observer=recorder) as engine:
        assert engine.stats().num_running == 0 and engine.stats().prefix_cache_hit_rate == 0.0
        prompt = list(range(1, 41))  # 40 tokens: two full 16-token blocks can be reused
        first_output = trio.Event()

        async def consume(token_ids):
            async for _ in engine.generate(token_ids, greedy(3, ignore_eos=True)):
                first_output.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, prompt)
            nursery.start_soon(consume, list(range(50, 61)))
            await first_output.wait()
            during = engine.stats()
        await final_output(engine, prompt, greedy(3, ignore_eos=True))
        after = engine.stats()
    assert (during.num_running, during.num_waiting) == (1, 1) and during.kv_cache_usage > 0
    assert (after.num_running, after.num_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (40 + 11 + 40, 32)
    assert after.prefix_cache_hit_rate == pytest.approx(32 / 91)
    assert after.workers_alive == (True,)
    # The probe ran in virtual time alongside the steps: nothing blocked the loop.
    assert recorder.lags and after.loop_lag_max == pytest.approx(0.0, abs=1e-9)
    assert after.loop_lag == recorder.lags[-1]
