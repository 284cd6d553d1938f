"""The engine core in a process of its own (`open_engine_process`), as `trio-llm serve` runs it:
the same outputs as in process, its death handled like a worker's, nothing left running."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from bench.http import Reader, open_request, request
from engine import EngineDeadError, InvalidRequestError, ModelLoadError, SamplingParams, open_engine
from engine.api import open_engine_process
from engine.core.core_client import CoreClient
from engine.core.engine_spawn import engine_process_started
from engine.sampling_params import RequestOutputKind
from tests.conftest import engine_config
from tests.server_fixtures import running_server
from web.app import engine_in_own_process


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def finals(engine, prompts, params) -> list:
    results = {}
    async for index, output in engine.generate_batch(prompts, params, request_id="batch"):
        results[index] = output
    return [results[i] for i in range(len(prompts))]


PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(30, 70)), "a text prompt"]


async def test_outputs_are_the_in_process_engines(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, n=2, stop=["zz"],
                            output_kind=RequestOutputKind.CUMULATIVE)
    config = engine_config(tiny_model_dir, executor=None)
    async with open_engine(config) as engine:
        here = await finals(engine, PROMPTS, params)
    async with open_engine_process(config) as engine:
        assert isinstance(engine.core, CoreClient) and engine.core.pid != os.getpid()
        there = await finals(engine, PROMPTS, params)
        await engine.core.wait_until_idle()
        assert engine.core.num_requests == 0 and engine.core.num_steps > 0
        assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0
    for a, b in zip(here, there, strict=True):
        assert (a.request_id, a.prompt, a.prompt_token_ids, a.num_prompt_tokens, a.finished) == \
            (b.request_id, b.prompt, b.prompt_token_ids, b.num_prompt_tokens, b.finished)
        assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in a.outputs] == \
            [(c.index, c.text, c.token_ids, c.finish_reason) for c in b.outputs]
        for c, d in zip(a.outputs, b.outputs, strict=True):
            assert same_logprobs(c.logprobs, d.logprobs)


def same_logprobs(here: list, there: list) -> bool:
    """The same candidates, ranks and texts at every position; values equal to float noise. The two
    engines may batch the requests differently (the process's requests arrive a little apart), and a
    matmul over another batch shape rounds differently in the last bits."""
    def exact(positions):
        return [{tid: (lp.rank, lp.decoded_token) for tid, lp in pos.items()} for pos in positions]

    def values(positions):
        return [lp.logprob for pos in positions for _, lp in sorted(pos.items())]

    return exact(here) == exact(there) and values(here) == pytest.approx(values(there), abs=1e-4)


async def test_a_duplicate_id_and_an_abort_leave_the_engine_serving(tiny_model_dir):
    async with open_engine_process(engine_config(tiny_model_dir, executor=None)) as engine:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        outputs = engine.generate([1, 2, 3], params, request_id="dup")
        assert not (await outputs.__anext__()).finished
        with pytest.raises(InvalidRequestError, match="already in use"):
            async for _ in engine.generate([4, 5], params, request_id="dup"):
                pass
        await outputs.aclose()  # aborts "dup" in the engine process
        await engine.core.wait_until_idle()
        assert engine.core.num_requests == 0 and engine.stats().kv_cache_usage == 0
        final = [o async for o in engine.generate([7, 8], SamplingParams(max_tokens=3, ignore_eos=True))][-1]
        assert len(final.outputs[0].token_ids) == 3


async def test_kill_9_of_the_engine_process_fails_requests_and_health_at_once(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir, max_model_len=512, executor=None)) as server:
        failed = trio.Event()
        server.state.on_engine_failure = failed.set
        engine_process = server.engine.core.process
        body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with await open_request(server.url, "POST", "/v1/completions", body) as stream:
            response = Reader(stream)
            await response.until(b"data: {")  # generating
            os.kill(engine_process.pid, signal.SIGKILL)
            with trio.fail_after(1):
                rest = await response.until(b"data: [DONE]")
                await failed.wait()
        assert b'"error"' in rest and b"engine process" in rest and b"killed by SIGKILL" in rest
        assert (await request(server.url, "GET", "/health")).status == 503
        assert "exited unexpectedly (killed by SIGKILL)" in repr(server.state.engine_error)
        refused = await request(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503
    assert_gone(engine_process.pid)


async def test_kill_9_while_idle_fails_health_at_once(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir, executor=None)) as server:
        assert (await request(server.url, "GET", "/health")).status == 200
        failed = trio.Event()
        server.state.on_engine_failure = failed.set
        os.kill(server.engine.core.pid, signal.SIGKILL)  # nothing is running: no request will notice
        with trio.fail_after(1):
            await failed.wait()
        assert (await request(server.url, "GET", "/health")).status == 503


async def test_leaving_the_block_ends_open_requests_and_the_process(tiny_model_dir):
    errors = []

    async def consume(engine, task_status=trio.TASK_STATUS_IGNORED):
        try:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)):
                if task_status is not trio.TASK_STATUS_IGNORED:
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
        except EngineDeadError as exc:
            errors.append(exc)

    config = engine_config(tiny_model_dir, executor=None)
    async with trio.open_nursery() as nursery, open_engine_process(config) as engine:
        pid = engine.core.pid
        await nursery.start(consume, engine)  # generating when the block is left
    assert len(errors) == 1 and "closed before the request finished" in str(errors[0])
    assert_gone(pid)


async def test_cancelling_the_owner_stops_the_process(tiny_model_dir):
    with trio.move_on_after(60) as scope:
        async with open_engine_process(engine_config(tiny_model_dir, executor=None)) as engine:
            pid = engine.core.pid
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert_gone(pid)


async def test_start_up_failures_are_the_in_process_ones(tmp_path):
    missing = tmp_path / "no-model"
    with pytest.raises(ModelLoadError) as here:
        async with open_engine(engine_config(str(missing), executor=None)):
            pass
    with pytest.raises(ModelLoadError) as there:
        async with open_engine_process(engine_config(str(missing), executor=None)):
            pass
    assert str(there.value) == str(here.value)


async def test_an_engine_process_started_early_is_adopted_then_stopped_with_the_engine(tiny_model_dir):
    """`trio-llm serve` starts the engine process before importing the server; the engine opened
    later runs in that very process, and closing it stops the process."""
    async with engine_process_started() as spawned:
        async with open_engine_process(engine_config(tiny_model_dir, executor=None), spawned=spawned) as engine:
            assert engine.core.pid == spawned.process.pid
            (output,) = await finals(engine, PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(output.outputs[0].token_ids) == 3
        assert spawned.process.returncode is not None
    assert_gone(spawned.process.pid)


async def test_an_engine_process_never_adopted_is_stopped_on_leaving_the_block():
    """A server whose start fails before it opens the engine (a bad import, say) leaves no
    engine process behind, even cancelled."""
    with trio.CancelScope() as scope:
        async with engine_process_started() as spawned:
            scope.cancel()
            await trio.sleep_forever()
    assert spawned.process.returncode is not None
    assert_gone(spawned.process.pid)


def test_the_server_runs_the_engine_apart_unless_one_process_is_asked_for(tiny_model_dir):
    from web.http.settings import ServerSettings
    from web.http.state import ServerState
    assert engine_in_own_process(ServerState(engine_config(tiny_model_dir, executor=None), ServerSettings()))
    assert engine_in_own_process(ServerState(engine_config(tiny_model_dir, executor="mp"), ServerSettings()))
    assert not engine_in_own_process(ServerState(engine_config(tiny_model_dir, executor="inproc"), ServerSettings()))


def test_a_bursts_reports_after_its_first_carry_no_stats_until_something_changes():
    """Within a decode burst (the core's steps, its requests and the messages it has read unchanged;
    nothing ended, nothing answered) a report carries no stats, and the client keeps the last; any
    of those changing brings them back."""
    from engine.core.engine_main import Outbox

    class Core:
        num_steps, num_requests, num_pending_messages, dead, taken = 3, 1, 0, False, 0

        def stats(self):
            self.taken += 1
            return f"stats {self.taken}"

    outbox, core = Outbox(), Core()

    def report(request_id="r", item="token"):
        outbox.put(request_id, item)
        return outbox.take(core)[2].stats

    assert report() == "stats 1"
    assert report() is None and report() is None  # the burst's later steps
    assert report(item=None) == "stats 2"  # a request ended
    core.num_steps += 1  # the burst ended: the next step's report
    assert report() == "stats 3"
    assert report() is None
    outbox.adds_received += 1  # an ADD was read meanwhile
    assert report() == "stats 4"
    core.num_pending_messages = 1
    assert report() == "stats 5"
    outbox.answer(7, None)
    assert outbox.take(core)[2].stats == "stats 6"
    core.num_requests = 2
    assert report() == "stats 7"
