"""The multi-process executor with real worker processes: RPC, tensor parallelism, worker death, shutdown."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import trio

from bench.http import Reader, open_request, request
from engine import EngineDeadError, ModelLoadError, SamplingParams, open_engine
from engine import testing as probes
from engine.executor import create_executor
from engine.executor.multiproc import MultiprocExecutor
from engine.executor.rpc import WorkerError
from tests.conftest import engine_config
from tests.server_fixtures import running_server

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(30, 70)), [400, 2, 9, 77, 301], [11] * 20]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def greedy_outputs(config) -> list:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    async with open_engine(config) as engine:
        finals = {}
        async for index, output in engine.generate_batch(PROMPTS, params):
            finals[index] = output.outputs[0]
    return [finals[i] for i in range(len(PROMPTS))]


async def test_tensor_parallel_2_generates_what_one_process_does(tiny_model_dir):
    single = await greedy_outputs(engine_config(tiny_model_dir))
    parallel = await greedy_outputs(engine_config(tiny_model_dir, tensor_parallel_size=2))
    for one, two in zip(single, parallel, strict=True):
        assert two.token_ids == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert len({tuple(o.token_ids) for o in single}) > 1  # the prompts do lead to different outputs


async def test_collective_rpc_reaches_every_rank_and_reports_errors_on_their_own_call(tiny_model_dir):
    await check_collective_rpc(tiny_model_dir, "mp")  # and under "ray": tests/test_ray_executor.py


async def check_collective_rpc(tiny_model_dir: str, backend: str) -> None:
    config = engine_config(tiny_model_dir, tensor_parallel_size=2, executor=backend)
    async with create_executor(config) as executor:
        await executor.load_model()
        assert [s["rank"] for s in await executor.collective_rpc(probes.model_summary)] == [0, 1]
        full = (await executor.collective_rpc(probes.model_summary, unique_reply_rank=1))
        assert full["rank"] == 1 and full["local_kv_heads"] == 1  # 2 KV heads split over 2 ranks
        failing = await executor.collective_rpc("no_such_method", non_block=True)
        after = await executor.collective_rpc("ping", non_block=True)
        assert await after.result() == ["pong", "pong"]
        with pytest.raises(WorkerError, match="AttributeError") as info:
            await failing.result()
        assert "no_such_method" in info.value.remote_traceback
        pids = list(executor.worker_pids())
    assert_gone(pids)


async def test_a_worker_that_cannot_start_fails_the_start_with_its_error(tiny_model_dir):
    crashing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    executor = MultiprocExecutor(engine_config(tiny_model_dir, tensor_parallel_size=2), worker_command=crashing)
    with pytest.raises(ModelLoadError, match=r"rank [01] exited during start-up \(exit code 3\)"):
        async with executor:
            pass
    assert all(p.returncode is not None for p in executor.processes)
    raising = [sys.executable, "-c", "from tests.test_multiproc import serve_failing_worker; serve_failing_worker()"]
    executor = MultiprocExecutor(engine_config(tiny_model_dir), worker_command=raising)
    with pytest.raises(ModelLoadError, match="failed to start:(.|\n)*no GPU here"):
        async with executor:
            pass
    assert all(p.returncode is not None for p in executor.processes)


def serve_failing_worker() -> None:
    """A worker process whose Worker constructor raises (run by the test above)."""
    import argparse
    import socket

    from engine.worker.worker_main import serve_worker

    def build(init):
        raise RuntimeError("no GPU here")

    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int)
    parser.add_argument("--parent-pid", type=int)
    args = parser.parse_args()

    async def main():
        sock = socket.socket(fileno=args.fd)
        async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
            await serve_worker(stream, build)

    trio.run(main)


async def test_cancelling_the_owner_still_stops_every_worker(tiny_model_dir):
    pids = []
    with trio.move_on_after(60) as scope:
        async with open_engine(engine_config(tiny_model_dir, tensor_parallel_size=2)) as engine:
            pids = [p.pid for p in engine.core.executor.processes]
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught and len(pids) == 2
    assert_gone(pids)


async def test_kill_9_of_a_worker_during_generation_fails_requests_fast(tiny_model_dir):
    config = engine_config(tiny_model_dir, tensor_parallel_size=2, max_model_len=512)
    async with running_server(config) as server:
        engine_process, worker_pids = server.engine.core.process, server.engine.core.worker_pids
        body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with await open_request(server.url, "POST", "/v1/completions", body) as stream:
            response = Reader(stream)
            await response.until(b"data: {")  # generating
            os.kill(worker_pids[1], signal.SIGKILL)
            with trio.fail_after(1):
                rest = await response.until(b"data: [DONE]")
        assert b'"error"' in rest and b"exited unexpectedly" in rest and b"killed by SIGKILL" in rest
        assert (await request(server.url, "GET", "/health")).status == 503  # the engine was dead before the error
        with trio.fail_after(5):
            await engine_process.wait()  # it stops and reaps the other rank, then exits
        refused = await request(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503
    assert len(worker_pids) == 2
    assert_gone(list(worker_pids))


async def test_engine_dead_error_reaches_library_callers(tiny_model_dir):
    seen = []
    # Leaving open_engine re-raises the step loop's failure; the caller got EngineDeadError.
    with pytest.RaisesGroup(pytest.RaisesExc(EngineDeadError, match=r"rank 0 .*\(killed by SIGKILL\)"),
                            flatten_subgroups=True):
        async with open_engine(engine_config(tiny_model_dir, executor="mp")) as engine:
            process = engine.core.executor.processes[0]
            with pytest.raises(EngineDeadError, match="rank 0") as info:
                async for output in engine.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)):
                    if len(output.outputs[0].token_ids) == 2:
                        os.kill(process.pid, signal.SIGKILL)
            seen.append(info.value)
            assert not engine.is_running
    assert seen and process.returncode == -signal.SIGKILL


async def test_prompt_embeddings_cross_the_process_boundary(tiny_model_dir):
    from tests.test_prompt_embeds import embedding_table
    ids = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = engine_config(tiny_model_dir, tensor_parallel_size=2, enable_prompt_embeds=True)
    async with open_engine(config) as engine:
        outputs = []
        for prompt in (ids, embedding_table(tiny_model_dir)[ids]):
            final = [output async for output in engine.generate(prompt, params)][-1]
            outputs.append(final.outputs[0].token_ids)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("layout", [{"executor": "mp"}, {"tensor_parallel_size": 2}])
async def test_a_worker_killed_while_idle_fails_health_at_once(tiny_model_dir, layout):
    async with running_server(engine_config(tiny_model_dir, **layout)) as server:
        assert (await request(server.url, "GET", "/health")).status == 200
        failed = trio.Event()
        server.state.on_engine_failure = failed.set
        engine_process, worker_pids = server.engine.core.process, server.engine.core.worker_pids
        os.kill(worker_pids[-1], signal.SIGKILL)  # nothing is running: no request will notice
        # Noticed by watching the process, not by a heartbeat: well under a second on a quiet
        # machine; 5 s leaves room for a suite whose other worker compiles graphs on both cores
        # (1 s failed there once), still far from any request or heartbeat timeout.
        with trio.fail_after(5):
            await failed.wait()
        assert (await request(server.url, "GET", "/health")).status == 503
        assert "exited unexpectedly (killed by SIGKILL)" in repr(server.state.engine_error)
        refused = await request(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503
        with trio.fail_after(10):
            await engine_process.wait()  # it stops and reaps its workers, then exits
    assert worker_pids
    assert_gone(list(worker_pids))


async def test_serve_stops_and_exits_1_when_the_engine_dies(tiny_model_dir, caplog):
    from web.http.settings import ServerSettings
    from web.serve import serve
    config = engine_config(tiny_model_dir, executor="mp")
    executor = MultiprocExecutor(config)
    status = []

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        status.append(await serve(config, ServerSettings(grace_period=1), "127.0.0.1", 0, executor=executor,
                                  shutdown_trigger=trio.sleep_forever, log_level="error", task_status=task_status))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(run)
            assert (await request(url, "GET", "/health")).status == 200
            os.kill(executor.processes[0].pid, signal.SIGKILL)
    assert status == [1]  # serve returned by itself, with the status the CLI exits with
    # One line naming how the engine ended, not a traceback of every task it passed through.
    (death,) = [r for r in caplog.records if r.getMessage().startswith("the engine failed")]
    assert "exited unexpectedly (killed by SIGKILL)" in death.getMessage() and death.exc_info is None
