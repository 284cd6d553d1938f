"""Pipeline parallelism: layers split over stages of worker processes, steps in flight at once."""

from __future__ import annotations

import pytest
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from engine import SamplingParams, open_engine
from engine import testing as probes
from engine.executor.base import PendingStep
from engine.models.parallel import PipelineStage
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.test_multiproc import PROMPTS
from tests.test_ray_executor import LLAMA


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return four_layer_llama(tmp_path_factory)


def four_layer_llama(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A transformers Llama of 4 layers (two per stage) and its greedy continuations of PROMPTS."""
    path, model = save_hf_checkpoint(tmp_path_factory, "llama-pp", LlamaConfig, LlamaForCausalLM,
                                     {**LLAMA, "num_hidden_layers": 4})
    return str(path), transformers_greedy(model, PROMPTS, 8)


async def greedy(config) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with open_engine(config) as engine:
        finals = {}
        async for index, output in engine.generate_batch(PROMPTS, params):
            finals[index] = output.outputs[0].token_ids
    return [finals[i] for i in range(len(PROMPTS))]


async def test_pipeline_stages_generate_transformers_greedy_tokens(llama):
    # With Ray: tests/test_ray_executor.py (the one file that starts a Ray cluster).
    path, expected = llama
    assert await greedy(engine_config(path, dtype="float32", pipeline_parallel_size=2, executor="mp")) == expected


async def test_stages_of_tensor_parallel_ranks_hold_their_own_layers_and_generate_greedy_tokens(llama):
    path, expected = llama
    config = engine_config(path, pipeline_parallel_size=2, tensor_parallel_size=2, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with open_engine(config) as engine:
        summaries = await engine.core.executor.collective_rpc(probes.model_summary)
        finals = {}
        async for index, output in engine.generate_batch(PROMPTS, params):
            finals[index] = output.outputs[0].token_ids
    assert [(s["rank"], s["stage"], s["layers"]) for s in summaries] == \
        [(0, 0, [0, 2]), (1, 0, [0, 2]), (2, 1, [2, 4]), (3, 1, [2, 4])]
    assert summaries[0]["local_kv_heads"] == 1  # two KV heads over two tensor-parallel ranks, per stage
    assert [finals[i] for i in range(len(PROMPTS))] == expected


def test_layers_split_evenly_the_first_stages_taking_the_rest():
    assert [PipelineStage(r, 3).layer_range(8) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        PipelineStage(0, 3).layer_range(2)


def test_vllms_layer_partition_places_the_layers(monkeypatch):
    assert [PipelineStage(r, 2).layer_range(24, (16, 8)) for r in range(2)] == [range(0, 16), range(16, 24)]
    with pytest.raises(ValueError, match="each of the 2 stages at least one layer and 24 in all"):
        PipelineStage(0, 2).layer_range(24, (20, 8))
    from web.cli import _parser
    from web.options import engine_config as config_from_flags
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    config = config_from_flags("m", _parser().parse_args(["serve", "m", "-pp", "2"]))
    assert (config.pipeline_parallel_size, config.pipeline_layer_partition) == (2, (3, 1))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "three,one")
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION must be layers per stage"):
        config_from_flags("m", _parser().parse_args(["serve", "m", "-pp", "2"]))


class PipelinedFake(FakeExecutor):
    """A fake model of `stages` stages: each takes `per_request` virtual seconds per scheduled
    request, and a stage runs one step at a time, in order (as a worker process does)."""

    def __init__(self, stages: int, per_request: float) -> None:
        super().__init__()
        self.stages, self.per_request = stages, per_request
        self.stage_free = [0.0] * stages
        self.in_flight = self.most_in_flight = 0

    @property
    def max_concurrent_batches(self) -> int:
        return self.stages

    async def start_model(self, sched_out: SchedulerOutput) -> PendingStep:
        done = trio.current_time()
        for stage in range(self.stages):
            done = max(done, self.stage_free[stage]) + self.per_request * len(sched_out.scheduled)
            self.stage_free[stage] = done
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        async def output() -> ModelRunnerOutput:
            await trio.sleep_until(done)
            self.in_flight -= 1
            return await self._step_now(sched_out)

        return PendingStep(wait=output)

    async def _step_now(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        saved, self.step_time = self.step_time, 0.0
        try:
            return await self._step(sched_out)
        finally:
            self.step_time = saved


async def decode_time(model_dir: str, stages: int, micro_batches: int) -> tuple[float, PipelinedFake, dict]:
    executor = PipelinedFake(stages, per_request=0.01)
    config = engine_config(model_dir, pipeline_parallel_size=micro_batches)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[i + 1, 2, 3] for i in range(8)]
    start = trio.current_time()
    async with open_engine(config, executor=executor) as engine:
        outputs = {i: out async for i, out in engine.generate_batch(prompts, params)}
    return trio.current_time() - start, executor, outputs


async def test_two_steps_in_flight_keep_both_stages_busy(autojump_clock, tiny_model_dir):
    one_at_a_time, _, alone = await decode_time(tiny_model_dir, stages=2, micro_batches=1)
    pipelined, executor, together = await decode_time(tiny_model_dir, stages=2, micro_batches=2)
    assert executor.most_in_flight == 2
    # Each request waits for its own step's two stages either way; the stages now overlap two
    # half-size steps instead of idling in turn.
    assert pipelined < 0.6 * one_at_a_time
    assert {i: o.outputs[0].token_ids for i, o in together.items()} == \
        {i: o.outputs[0].token_ids for i, o in alone.items()}
    assert all(len(o.outputs[0].token_ids) == 10 for o in together.values())
