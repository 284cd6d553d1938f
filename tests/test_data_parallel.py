"""Data parallelism: N engine processes behind one API server, balanced by load and prompt prefix."""

from __future__ import annotations

import os
import signal

import pytest
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from bench.http import Reader, open_request, request
from engine import EngineDeadError, SamplingParams
from engine.api import open_engine_process
from engine.core.data_parallel import PrefixMemory, choose_core, prefix_hashes, shared_cpus_warning, sum_stats
from engine.core.stats import EngineStats
from engine.cpu_binding import CpuLayout, split_layout
from tests.conftest import engine_config
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.server_fixtures import running_server
from tests.test_multiproc import PROMPTS, assert_gone
from tests.test_ray_executor import LLAMA


# ---- the balancer, plain ---------------------------------------------------------------------------
def test_the_least_loaded_live_core_takes_a_request_without_a_cached_prefix():
    assert choose_core([5, 2, 9], [0, 0, 0]) == 1
    assert choose_core([3, 3], [0, 0]) == 0  # ties: the lowest rank
    assert choose_core([None, 7], [0, 0]) == 1  # a dead core takes nothing
    with pytest.raises(EngineDeadError, match="every data-parallel engine"):
        choose_core([None, None], [0, 0])


def test_a_core_holding_the_prefix_wins_within_the_slack_only():
    assert choose_core([6, 0], [3, 0], slack=8) == 0  # busier, but holds 3 blocks of the prompt
    assert choose_core([9, 0], [3, 0], slack=8) == 1  # too much busier: the prefix is not worth the wait
    assert choose_core([2, 2, 0], [1, 4, 0], slack=8) == 1  # the longest match
    assert choose_core([None, 0], [5, 0], slack=8) == 1  # a dead core's cache is no use


def test_prefix_hashes_name_whole_blocks_and_their_whole_prefix():
    a = prefix_hashes(list(range(40)), block_size=16)
    assert len(a) == 2  # the last 8 tokens do not fill a block
    b = prefix_hashes(list(range(32)) + [99] * 16, block_size=16)
    assert b[:2] == a and len(b) == 3
    c = prefix_hashes([7] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a block is named with everything before it
    assert len(prefix_hashes(list(range(1000)), block_size=16, limit=4)) == 4


def test_prefix_memory_counts_leading_blocks_and_forgets_the_oldest():
    memory = PrefixMemory(capacity=3)
    memory.remember([1, 2])
    assert memory.matched_blocks([1, 2, 3]) == 2 and memory.matched_blocks([5, 2]) == 0  # leading blocks only
    memory.remember([7, 8])  # four entries for three places: 1 (the oldest) goes
    assert memory.matched_blocks([1, 2]) == 0 and memory.matched_blocks([7, 8]) == 2


def test_compute_cpus_split_between_engines():
    layout = CpuLayout(compute=(1, 2, 3, 4, 5), server=(0,))
    assert [part.compute for part in split_layout(layout, 2)] == [(1, 2, 3), (4, 5)]
    assert all(part.server == (0,) for part in split_layout(layout, 2))
    assert [part.compute for part in split_layout(CpuLayout((1,), (0,)), 2)] == [(1,), (1,)]  # they share
    assert split_layout(None, 3) == [None, None, None]


def test_engines_that_must_share_compute_cpus_are_warned_about():
    shared = engine_config("m", data_parallel_size=2, cpu_layout=CpuLayout((1,), (0,)))
    assert shared_cpus_warning(shared) == ("2 data-parallel engines share 1 compute CPU(s) (CPU 1): they take turns "
                                           "on them, so -dp 2 serves no faster than one engine here; each engine "
                                           "needs CPUs of its own (--cpu-threads-bind)")
    for config in (engine_config("m", data_parallel_size=2, cpu_layout=CpuLayout((1, 2), (0,))),
                   engine_config("m", data_parallel_size=2, cpu_layout=None), engine_config("m")):
        assert shared_cpus_warning(config) is None


def test_engine_stats_sum_counts_and_average_usage():
    def stats(running, waiting, usage, alive):
        return EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage, prefix_cache_queries=10,
                           prefix_cache_hits=4, num_preemptions=1, loop_lag=None, loop_lag_max=None,
                           workers_alive=alive, running_lora_adapters=("a",))
    total = sum_stats([stats(2, 1, 0.5, (True,)), stats(3, 0, 0.25, (False,))])
    assert (total.num_running, total.num_waiting, total.prefix_cache_hits, total.num_preemptions) == (5, 1, 8, 2)
    assert total.kv_cache_usage == pytest.approx(0.375)
    assert total.workers_alive == (True, False) and total.running_lora_adapters == ("a",)


def test_data_parallelism_needs_engine_processes():
    with pytest.raises(ValueError, match="engine process per rank"):
        engine_config("m", data_parallel_size=2, executor="inproc")
    from web.cli import _parser
    from web.options import engine_config as config_from_flags
    assert config_from_flags("m", _parser().parse_args(["serve", "m", "-dp", "2"])).data_parallel_size == 2


# ---- engines ---------------------------------------------------------------------------------------
async def test_two_engines_generate_transformers_greedy_tokens_and_share_the_requests(tmp_path_factory):
    path, model = save_hf_checkpoint(tmp_path_factory, "llama-dp", LlamaConfig, LlamaForCausalLM, LLAMA)
    expected = transformers_greedy(model, PROMPTS, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with open_engine_process(engine_config(str(path), data_parallel_size=2, dtype="float32")) as engine:
        finals = {}
        async for index, output in engine.generate_batch(PROMPTS, params):
            finals[index] = output.outputs[0].token_ids
        assert engine.core.sent == [2, 2]  # submitted in one burst: the queued ones spread them
        assert len(engine.engine_stats()) == 2
    assert [finals[i] for i in range(len(PROMPTS))] == expected


async def test_a_shared_prefix_goes_to_the_engine_that_holds_it(tiny_model_dir):
    prefix = list(range(100, 164))  # four whole blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    async with open_engine_process(engine_config(tiny_model_dir, data_parallel_size=2)) as engine:
        long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            first_token = trio.Event()

            async def hold_engine_0_busy() -> None:
                async for _ in engine.generate(prefix + [1, 2], long_params, request_id="busy"):
                    first_token.set()

            nursery.start_soon(hold_engine_0_busy)
            await first_token.wait()
            # Engine 0 runs a request, engine 1 nothing: by load alone this would go to engine 1.
            [_ async for _ in engine.generate(prefix + [9, 9, 9], params, request_id="same-prefix")]
            nursery.cancel_scope.cancel()  # cancelling the busy request's caller aborts it
        assert engine.core.sent == [2, 0]
        assert engine.engine_stats()[0].prefix_cache_hits >= len(prefix)


async def test_an_engine_that_dies_fails_only_its_requests_and_the_server_serves_on(tiny_model_dir):
    config = engine_config(tiny_model_dir, data_parallel_size=2, max_model_len=512)
    async with running_server(config) as server:
        clients = server.engine.core.cores
        body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with await open_request(server.url, "POST", "/v1/completions", body) as on_engine_0, \
                await open_request(server.url, "POST", "/v1/completions", body) as on_engine_1:
            first, second = Reader(on_engine_0), Reader(on_engine_1)
            await first.until(b"data: {")
            await second.until(b"data: {")
            assert server.engine.core.sent == [1, 1]
            os.kill(clients[1].process.pid, signal.SIGKILL)
            with trio.fail_after(5):
                rest = await second.until(b"data: [DONE]")
            assert b'"error"' in rest and b"exited unexpectedly" in rest
            assert (await request(server.url, "GET", "/health")).status == 200  # engine 0 serves on
            metrics = (await request(server.url, "GET", "/metrics")).body.decode()
            assert 'trio_llm_engine_requests_running{engine="0",model_name=' in metrics
            ok = await request(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert ok.status == 200 and server.engine.core.sent == [2, 1]
            with trio.fail_after(30):
                rest = await first.until(b"data: [DONE]")
            assert b'"error"' not in rest  # the request on the live engine ran to its end
        failed = trio.Event()
        server.state.on_engine_failure = failed.set
        os.kill(clients[0].process.pid, signal.SIGKILL)  # the last engine
        with trio.fail_after(5):
            await failed.wait()
        assert (await request(server.url, "GET", "/health")).status == 503
    assert_gone([client.process.pid for client in clients])
