"""The EPLB hand-off under MockClock: the step loop never waits for a transfer (asynchronous), or
waits for all of it at one step boundary (synchronous); and the options refused at start-up."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import trio

from engine import EngineConfig, open_engine
from engine.config import EplbConfig
from engine.models.tiny import TinyModelSpec, make_model
from engine.testing import FakeExecutor
from tests.helpers import final_output, greedy
from web.cli import main

STEP, STAGE = 0.01, 0.05  # a staging call takes five steps' time


class FakeMoeExecutor(FakeExecutor):
    """Two MoE layers of 4 experts on 2 ranks; experts 0 and 1 (both on rank 0) take every token."""

    def __init__(self) -> None:
        super().__init__(step_time=STEP)
        self.info = replace(self.info, num_moe_layers=2, num_logical_experts=4, num_physical_experts=4,
                            num_expert_ranks=2)
        self.timeline: list[tuple] = []

    async def execute_model(self, sched_out):
        start = trio.current_time()
        output = await super().execute_model(sched_out)
        commit = sched_out.eplb_commit.layer if sched_out.eplb_commit is not None else None
        self.timeline.append(("step", start, trio.current_time(), commit))
        output.expert_load = torch.tensor([[5, 5, 0, 0], [5, 5, 0, 0]])
        return output

    async def eplb_stage_layer(self, plan):
        start = trio.current_time()
        await trio.sleep(STAGE)
        self.timeline.append(("stage", start, trio.current_time(), plan.layer))

    async def collective_rpc(self, method, args=(), kwargs=None, **options):
        assert method == "eplb_commit_layer"
        self.timeline.append(("commit", trio.current_time(), trio.current_time(), args[0].layer))
        return [None, None]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    spec = TinyModelSpec(arch="mixtral", layers=2, hidden=32, heads=2, kv_heads=1, intermediate=32, vocab=300,
                         experts=4)
    return str(make_model(tmp_path_factory.mktemp("models") / "fake-moe", spec))


def config(moe_dir: str, use_async: bool) -> EngineConfig:
    return EngineConfig(model=moe_dir, num_kv_blocks=64, enable_eplb=True,
                        eplb_config=EplbConfig(window_size=8, step_interval=8, use_async=use_async))


async def run(moe_dir: str, use_async: bool) -> tuple[FakeMoeExecutor, object]:
    executor = FakeMoeExecutor()
    async with open_engine(config(moe_dir, use_async), executor=executor) as engine:
        await final_output(engine, [5, 6, 7], greedy(40, ignore_eos=True))
        stats = engine.stats().eplb
    return executor, stats


async def test_asynchronous_transfer_overlaps_steps_and_hands_layers_over_at_boundaries(moe_dir, autojump_clock):
    executor, stats = await run(moe_dir, use_async=True)
    steps = [e for e in executor.timeline if e[0] == "step"]
    stages = [e for e in executor.timeline if e[0] == "stage"]
    assert stats.rebalances >= 1 and len(stages) >= 2
    for _, start, end, layer in stages:
        # inference went on while the layer was staged: steps ran inside the staging window
        assert sum(1 for s in steps if start <= s[1] and s[2] <= end) >= 3
        adopting = [s for s in steps if s[3] == layer and s[1] >= end]
        assert adopting, f"layer {layer} was never adopted"
        assert adopting[0][1] >= end  # adopted only by a step that began after its staging ended
    # the next layer is staged only once the step that adopted the previous one is over
    first_adoption = next(s for s in steps if s[3] == stages[0][3])
    assert stages[1][1] >= first_adoption[2]
    assert not [e for e in executor.timeline if e[0] == "commit"]  # adopted in steps, never by a separate call


async def test_synchronous_transfer_runs_whole_at_one_step_boundary(moe_dir, autojump_clock):
    executor, stats = await run(moe_dir, use_async=False)
    assert stats.rebalances >= 1
    events = executor.timeline
    first = next(i for i, e in enumerate(events) if e[0] == "stage")
    kinds = [e[0] for e in events[first:first + 4]]
    assert kinds == ["stage", "commit", "stage", "commit"]  # both layers, no step in between
    assert all(e[3] is None for e in events if e[0] == "step")  # nothing rides on a step


@pytest.mark.parametrize("value, key", [
    ('{"window_size": "big"}', "window_size"),
    ('{"step_interval": 0}', "step_interval"),
    ('{"num_redundant_experts": -1}', "num_redundant_experts"),
    ('{"use_async": "yes"}', "use_async"),
    ('{"window": 10}', "window"),
    ('[]', "JSON object"),
])
def test_hostile_eplb_config_is_one_line_naming_the_key(moe_dir, capsys, value, key):
    assert main(["serve", moe_dir, "--port", "0", "--enable-eplb", "--eplb-config", value]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err


def test_expert_options_the_model_cannot_take_fail_before_any_worker_starts(moe_dir, tiny_model_dir, capsys):
    assert main(["serve", tiny_model_dir, "--port", "0", "--enable-eplb"]) != 0
    assert "needs a mixture-of-experts model" in capsys.readouterr().err
    # 4 experts + 5 redundant: more spare slots than experts
    assert main(["serve", moe_dir, "--port", "0", "--enable-eplb", "--eplb-config",
                 '{"num_redundant_experts": 5}']) != 0
    assert "num_redundant_experts (5) exceeds" in capsys.readouterr().err
    # 4 + 1 = 5 physical experts over 2 expert-parallel ranks
    assert main(["serve", moe_dir, "--port", "0", "--tensor-parallel-size", "2", "--enable-expert-parallel",
                 "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 1}']) != 0
    err = capsys.readouterr().err
    assert "do not split evenly over 2 expert-parallel ranks" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="needs enable_eplb"):
        EngineConfig(model=moe_dir, eplb_config=EplbConfig(num_redundant_experts=1))


async def test_prometheus_shows_rebalances_moves_balancedness_and_transfer_time(moe_dir, autojump_clock):
    from web.http.metrics import ServerMetrics

    metrics = ServerMetrics("moe")
    executor = FakeMoeExecutor()
    async with open_engine(config(moe_dir, use_async=True), executor=executor, observer=metrics) as engine:
        metrics.bind(engine.stats)
        await final_output(engine, [5, 6, 7], greedy(40, ignore_eos=True))
        stats = engine.stats().eplb
        text = metrics.render().decode()
    assert stats.rebalances >= 1
    assert f'trio_llm_eplb_rebalances_total{{model_name="moe"}} {float(stats.rebalances)}' in text
    assert f'trio_llm_eplb_experts_moved_total{{model_name="moe"}} {float(stats.experts_moved)}' in text
    assert 'trio_llm_eplb_balancedness{layer="1",model_name="moe"}' in text
    assert f'trio_llm_eplb_transfer_seconds_count{{model_name="moe"}} {float(stats.rebalances)}' in text
