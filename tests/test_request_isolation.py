"""One request that breaks inside a step fails alone; the engine keeps serving everyone else.

The API refuses such requests up front (and `SamplingParams` re-validates on every copy), so
these tests put a broken request straight into the worker, or have a fake worker report one,
to show the engine's second line of defence.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
import trio.testing

from engine import RequestFailedError, SamplingParams, open_engine
from engine.core.open_core import build_scheduler
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.sched.request import Request
from engine.testing import FakeExecutor
from engine.worker.worker import Worker
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


def _broken(**values) -> SamplingParams:
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for name, value in values.items():
        object.__setattr__(params, name, value)  # past validation: what a missed check would let through
    return params


@pytest.mark.parametrize("values, reason", [
    ({"seed": 2**70}, "Overflow"),  # torch.Generator.manual_seed, while the request is set up
    ({"min_p": "high"}, "Error"),  # the batch's sampling tensors cannot be built with this row
])
def test_the_worker_leaves_out_the_request_that_breaks_and_runs_the_rest(tiny_model_dir, values, reason):
    config = engine_config(tiny_model_dir)
    worker = Worker(config)
    info = worker.load_model()
    worker.initialize_kv_cache(64)
    scheduler = build_scheduler(config, replace(info, num_kv_blocks=64, max_model_len=256))
    scheduler.add_request(Request("good", [5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=4, seed=3),
                                  max_tokens=4))
    scheduler.add_request(Request("bad", [1, 2, 3], _broken(**values), max_tokens=4))
    out = worker.execute_model(scheduler.schedule())
    assert set(out.failed) == {"bad"} and reason in out.failed["bad"]
    assert set(out.sampled_token_ids) == {"good"}


class OneBadRequest(FakeExecutor):
    """Reports the request whose prompt starts with token 13 as failed, as the worker would."""

    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = await super().execute_model(sched_out)
        for item in sched_out.scheduled:
            if item.start_position == 0 and item.token_ids[0] == 13:
                out.sampled_token_ids.pop(item.request_id, None)
                out.failed[item.request_id] = "ValueError: Overflow when unpacking long long"
        return out


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_the_engine_fails_that_request_alone_and_keeps_serving(tiny_model_dir, autojump_clock):
    async with open_engine(engine_config(tiny_model_dir), executor=OneBadRequest(step_time=0.01)) as engine:
        results = {}

        async def good(i):
            results[i] = (await final_output(engine, [5, 6, 7], greedy(6, ignore_eos=True))).outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(good, i)
            with pytest.raises(RequestFailedError, match="failed in the engine: ValueError: Overflow") as info:
                await final_output(engine, [13, 14, 15], greedy(6, ignore_eos=True), request_id="bad-one")
        assert info.value.request_id == "bad-one"
        assert len(results) == 3 and all(len(tokens) == 6 for tokens in results.values())
        stats = engine.stats()
        assert engine.is_running and stats.num_running == 0 and stats.kv_cache_usage == 0.0
        assert len((await final_output(engine, [5, 6], greedy(2, ignore_eos=True))).outputs[0].token_ids) == 2
