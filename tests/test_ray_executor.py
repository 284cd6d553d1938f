"""The Ray executor: workers as Ray actors on a local Ray cluster, against transformers and worker loss.

The ordered-RPC and cancelled-step contracts run here with the same bodies as for `mp`
(tests/test_multiproc.py, tests/test_executor_contract.py), and pipeline stages on Ray with
tests/test_pipeline_parallel.py's: every test that needs Ray lives in this file, so one test
process starts a Ray cluster, not every process that meets such a test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from transformers import LlamaConfig, LlamaForCausalLM

from bench.http import Reader, open_request, request
from engine import EngineDeadError, SamplingParams, open_engine
from engine.executor.ray_executor import CONNECTION_LOST_GRACE, RayExecutor
from tests.conftest import engine_config
from tests.helpers import log_until
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.server_fixtures import running_server
from tests.test_multiproc import PROMPTS, assert_gone

# trio's idle worker threads retire after this many seconds in the no-cluster test's server (10 by default).
IDLE_TIMEOUT = 1

LLAMA = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def alive_actors() -> list:
    """Actors the Ray cluster counts alive (read from its control store: `ray.util.state` needs the
    dashboard, which the test cluster does not run)."""
    import ray
    return [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]


async def test_tensor_parallel_2_on_ray_generates_transformers_greedy_tokens_then_fails_fast_when_an_idle_actor_dies(
        ray_cluster, tmp_path_factory):
    """Greedy tokens from two ranks on Ray actors; then, with nothing running, rank 1's actor is
    killed: only the engine's watches can notice, and they fail the engine within the second the
    closed socket waits for Ray's reason (one engine start for both: an actor pair costs ~8 s of the
    suite). Ray names the actor's death when it reports within that second (on a busy machine it
    has not: the failure then says the connection closed)."""
    path, model = save_hf_checkpoint(tmp_path_factory, "llama-ray", LlamaConfig, LlamaForCausalLM, LLAMA)
    expected = transformers_greedy(model, PROMPTS, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = engine_config(str(path), executor="ray", tensor_parallel_size=2, dtype="float32")
    finals = {}
    # Leaving open_engine re-raises the failure the engine stopped with.
    with pytest.RaisesGroup(pytest.RaisesExc(EngineDeadError, match="rank 1"), flatten_subgroups=True):
        async with open_engine(config) as engine:
            executor = engine.core.executor
            assert isinstance(executor, RayExecutor) and len(set(executor.worker_pids())) == 2
            assert all(p.node_ip and p.node_id for p in executor.placements)  # where each rank runs, for the log
            async for index, output in engine.generate_batch(PROMPTS, params):
                finals[index] = output.outputs[0].token_ids
            await trio.testing.wait_all_tasks_blocked()  # idle
            os.kill(executor.worker_pids()[1], signal.SIGKILL)  # nothing runs: only the watch can notice
            with trio.fail_after(CONNECTION_LOST_GRACE + 1):  # the grace, and a second for a busy machine
                error = await executor.wait_for_failure()
            assert isinstance(error, EngineDeadError)
            assert "worker rank 1 (node" in str(error)
            assert any(how in str(error) for how in ("ended unexpectedly: ActorDiedError",
                                                     "ended unexpectedly: its connection closed (Ray had not"))
            assert "\n" not in str(error)
            assert executor.workers_alive() == (True, False)
            with pytest.raises(EngineDeadError, match="rank 1"):
                await executor.collective_rpc("execute_model", (None,))
            await trio.testing.wait_all_tasks_blocked()  # the core has taken the failure in
            assert not engine.is_running
    assert [finals[i] for i in range(len(PROMPTS))] == expected
    assert_gone(list(executor.worker_pids()))  # the actors were killed on the way out
    assert not alive_actors()


async def test_a_killed_actor_fails_the_engine_even_when_ray_is_slow_to_say_so(ray_cluster, tiny_model_dir,
                                                                                monkeypatch):
    """Ray's report of rank 1's end never comes (its watch is held back, as a busy machine held it
    past a second once): the closed socket alone fails the engine after its grace, naming it."""
    watch = RayExecutor._watch

    async def silent_for_rank_1(self, rank):
        if rank == 1:
            await trio.sleep_forever()
        await watch(self, rank)

    monkeypatch.setattr(RayExecutor, "_watch", silent_for_rank_1)
    config = engine_config(tiny_model_dir, executor="ray", tensor_parallel_size=2)
    with pytest.RaisesGroup(pytest.RaisesExc(EngineDeadError, match="rank 1"), flatten_subgroups=True):
        async with open_engine(config) as engine:
            executor = engine.core.executor
            await trio.testing.wait_all_tasks_blocked()  # idle
            os.kill(executor.worker_pids()[1], signal.SIGKILL)
            with trio.fail_after(CONNECTION_LOST_GRACE + 1):
                error = await executor.wait_for_failure()
            assert "worker rank 1 (node" in str(error)
            assert "its connection closed (Ray had not reported why within 1 s)" in str(error)
            assert executor.workers_alive() == (True, False)
            await trio.testing.wait_all_tasks_blocked()  # the core has taken the failure in
            assert not engine.is_running
            executor._ended[1].set()  # its watch stays silent: do not wait for it on the way out
    assert not alive_actors()


async def test_an_actor_killed_mid_stream_ends_the_stream_with_an_error_and_leaves_nothing(ray_cluster,
                                                                                          tiny_model_dir):
    config = engine_config(tiny_model_dir, executor="ray", tensor_parallel_size=2, max_model_len=512)
    async with running_server(config) as server:
        engine_process, worker_pids = server.engine.core.process, server.engine.core.worker_pids
        body = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with await open_request(server.url, "POST", "/v1/completions", body) as stream:
            response = Reader(stream)
            await response.until(b"data: {")  # generating
            os.kill(worker_pids[0], signal.SIGKILL)
            with trio.fail_after(5):
                rest = await response.until(b"data: [DONE]")
        assert b'"error"' in rest and b"worker rank 0" in rest
        assert (await request(server.url, "GET", "/health")).status == 503
        with trio.fail_after(10):
            await engine_process.wait()  # it kills the other actor and leaves the cluster, then exits
    assert len(worker_pids) == 2
    assert_gone(list(worker_pids))
    assert not alive_actors()


def test_vllms_backend_flag_picks_the_executor():
    from web.cli import _parser
    from web.options import engine_config as config_from_flags

    def backend(*flags: str) -> str:
        return config_from_flags("m", _parser().parse_args(["serve", "m", *flags])).executor_kind

    assert backend("--distributed-executor-backend", "ray") == "ray"
    assert backend("--distributed-executor-backend", "mp") == "mp"
    assert backend("--distributed-executor-backend", "uni") == "inproc"
    assert backend("--executor", "inproc") == "inproc"  # trio-llm's older name for the same flag
    assert backend() == "inproc" and backend("--tensor-parallel-size", "2") == "mp"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "m", "--distributed-executor-backend", "external_launcher"])


async def test_the_cancelled_step_contract_holds_under_ray(ray_cluster, tiny_model_dir):
    from tests.test_executor_contract import check_a_cancelled_step_ends_before_the_cancellation_is_raised
    await check_a_cancelled_step_ends_before_the_cancellation_is_raised(tiny_model_dir, "ray")


async def test_collective_rpc_under_ray_reaches_every_rank_and_reports_errors_on_their_own_call(ray_cluster,
                                                                                                tiny_model_dir):
    from tests.test_multiproc import check_collective_rpc
    await check_collective_rpc(tiny_model_dir, "ray")


async def test_pipeline_stages_on_ray_generate_transformers_greedy_tokens(ray_cluster, tmp_path_factory):
    from tests.test_pipeline_parallel import four_layer_llama, greedy
    path, expected = four_layer_llama(tmp_path_factory)
    assert await greedy(engine_config(path, dtype="float32", pipeline_parallel_size=2, executor="ray")) == expected


def test_serve_on_ray_without_a_cluster_starts_a_local_one_and_leaves_nothing(tiny_model_dir, tmp_path):
    """A newcomer's `trio-llm serve MODEL --distributed-executor-backend ray -tp 2` with no
    RAY_ADDRESS: the local Ray instance outlives trio's idle worker threads (Ray's daemons die with
    the thread that started them), SIGTERM stops it quietly, and neither a session directory nor an
    auth token is left behind. trio's idle timeout is cut from 10 s to IDLE_TIMEOUT in the server's
    processes (a `sitecustomize` on their path) so that the test need not wait 10 s."""
    home = tmp_path / "home"
    home.mkdir()
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        f"import trio._core._thread_cache\ntrio._core._thread_cache.IDLE_TIMEOUT = {IDLE_TIMEOUT}\n")
    temp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=str(home), TMPDIR=str(temp), XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME",
                                                                               os.path.expanduser("~/.cache")),
               PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "web.cli", "serve", tiny_model_dir, "--host", "127.0.0.1", "--port", "0",
               "--distributed-executor-backend", "ray", "-tp", "2", "--enforce-eager", "--kv-cache-memory-bytes",
               str(1 << 24)]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        log = log_until(server, "Serving on")
        (started,) = [line for line in log if "Started a local Ray instance" in line]
        ray_up = datetime.strptime(started[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # Ray's log line
        url = log[-1].split("Serving on ")[1].split()[0]
        body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/completions", json=body).status_code == 200
            # The condition under test: trio retires the thread that started Ray once it has been idle
            # IDLE_TIMEOUT s (the engine's start-up after `ray.init` usually takes that long already).
            assert "IDLE_TIMEOUT = 1" in subprocess.run(
                [sys.executable, "-c", "import trio._core._thread_cache as c; print('IDLE_TIMEOUT =', c.IDLE_TIMEOUT)"],
                env=env, capture_output=True, text=True, check=True).stdout  # the hook reaches the server's processes
            time.sleep(max(0.0, ray_up + IDLE_TIMEOUT + 1 - time.time()))
            later = client.post("/v1/completions", json=body)
            assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 4
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        rest = server.stderr.read()
        assert "SIGTERM received at time" not in rest and "Traceback" not in rest, rest[-3000:]
        assert not (home / ".ray").exists() and list(temp.iterdir()) == []
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(temp)
