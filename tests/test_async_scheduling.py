"""Async scheduling (vLLM's --async-scheduling): the core schedules step N+1 while step N runs,
the decode's input the token step N is sampling (engine/sched/scheduler.py, the worker fills it
in), and each step's output is awaited behind its device event (engine/executor/step_queue.py)."""

from __future__ import annotations

import threading

import pytest
import trio

from bench.http import request
from engine import EngineConfig, open_engine
from engine.concurrency.device_event import FakeDeviceBackend
from engine.executor.inproc import InProcExecutor
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner, StepSample
from tests.conftest import engine_config
from tests.helpers import final_output, greedy
from tests.server_fixtures import running_server

PROMPTS = [[5, 6, 7], list(range(40, 100)), [9] * 20, [11, 12]]


async def _tokens(config, params: list[SamplingParams]) -> list[list[int]]:
    got: dict[int, list[int]] = {}
    async with open_engine(config) as engine:
        async def run(i: int) -> None:
            got[i] = list((await final_output(engine, PROMPTS[i], params[i])).outputs[0].token_ids)
        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
    return [got[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("executor", ["inproc", "mp"])
async def test_async_scheduling_gives_the_synchronous_engines_tokens(tiny_model_dir, executor):
    """Greedy, seeded sampling, a stop token met mid-stream (the step scheduled past it is dropped)
    and max_tokens of 1: the same tokens as the engine scheduling one step at a time."""
    params = [greedy(12, ignore_eos=True), SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
              greedy(1, ignore_eos=True), greedy(9, ignore_eos=True)]
    want = await _tokens(engine_config(tiny_model_dir), params)
    params[0] = greedy(12, ignore_eos=True, stop_token_ids=[want[0][4]])  # stops at its fifth token
    want[0] = want[0][:want[0].index(want[0][4]) + 1]
    got = await _tokens(engine_config(tiny_model_dir, async_scheduling=True, executor=executor), params)
    assert got == want


async def test_the_next_step_is_scheduled_while_one_is_on_the_device_and_http_is_served(tiny_model_dir):
    """A fake device holds each step's output until the test lets it go: while the prompt's step
    is still on the device, its first decode is already scheduled and queued (two steps in flight,
    never three), and the server answers other requests; then the completion equals the
    synchronous engine's."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with running_server(engine_config(tiny_model_dir)) as server:
        want = (await request(server.url, "POST", "/v1/completions", body)).json()["choices"][0]["text"]
    device = FakeDeviceBackend()
    config = engine_config(tiny_model_dir, async_scheduling=True)
    async with running_server(config, executor=InProcExecutor(config, device_backend=device)) as server:
        answer = {}

        async def complete() -> None:
            answer["body"] = (await request(server.url, "POST", "/v1/completions", body)).json()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete)
            await device.wait_until_recorded(2)  # the prompt's step, and the decode scheduled after it
            assert len(device.pending) == 2  # neither is done on the device
            assert (await request(server.url, "GET", "/health")).status == 200
            models = await request(server.url, "GET", "/v1/models")
            assert models.status == 200 and models.json()["data"]
            assert server.engine.stats().num_running == 1 and device.recorded == 2  # one step ahead, no more
            for steps in (3, 4):  # each step done lets the core schedule one more, up to max_tokens
                device.complete(1)
                await device.wait_until_recorded(steps)
            device.complete()  # the last two: the completion ends and the nursery with it
        assert answer["body"]["choices"][0]["text"] == want and answer["body"]["usage"]["completion_tokens"] == 4
        assert device.recorded == 4


async def test_the_host_waits_for_a_steps_tokens_only_once_the_next_step_is_queued(tiny_model_dir, monkeypatch):
    """The decode scheduled behind a step takes that step's token on the device (a placeholder
    filled there), so the worker queues its forward pass before it reads the token back: with a
    fake device holding every step, the worker has run two forward passes and read one sample,
    the first, after the second pass; the engine core has read none. Then the completion equals
    the synchronous engine's."""
    log: list[str] = []
    forward, read = ModelRunner._forward, StepSample.read

    def logged_forward(runner, batch, from_device):
        log.append(f"forward {len(from_device)} from the device")
        return forward(runner, batch, from_device)

    def logged_read(sample):
        in_the_core = threading.current_thread() is threading.main_thread()
        log.append(f"read in {'the core' if in_the_core else 'the worker'}")
        return read(sample)

    monkeypatch.setattr(ModelRunner, "_forward", logged_forward)
    monkeypatch.setattr(StepSample, "read", logged_read)
    want = (await _tokens(engine_config(tiny_model_dir), [greedy(3, ignore_eos=True)] * len(PROMPTS)))[0]
    log.clear()
    device = FakeDeviceBackend()
    config = engine_config(tiny_model_dir, async_scheduling=True)
    async with open_engine(config, executor=InProcExecutor(config, device_backend=device)) as engine:
        got = {}

        async def complete() -> None:
            got["ids"] = list((await final_output(engine, PROMPTS[0], greedy(3, ignore_eos=True))).outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete)
            await device.wait_until_recorded(2)
            assert log == ["forward 0 from the device", "forward 1 from the device", "read in the worker"]
            device.complete(1)  # the first done lets the core schedule the third, the last
            await device.wait_until_recorded(3)
            device.complete()
    assert got["ids"] == want


def test_async_scheduling_is_on_by_default_where_vllm_has_it_and_needs_one_worker(tiny_model_dir):
    """vLLM 0.14+: on by default, but for its CPU backend and pipeline parallelism."""
    assert EngineConfig(model="m", device="cuda").schedules_async
    assert not EngineConfig(model="m").schedules_async
    assert not EngineConfig(model="m", device="cuda", pipeline_parallel_size=2, executor="mp").schedules_async
    assert not EngineConfig(model="m", device="cuda", async_scheduling=False).schedules_async
    with pytest.raises(ValueError, match="async_scheduling runs with one worker"):
        engine_config(tiny_model_dir, async_scheduling=True, tensor_parallel_size=2)
