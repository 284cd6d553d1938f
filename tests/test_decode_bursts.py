"""Decode bursts (vLLM v0's multi-step scheduling, `num_scheduler_steps`): while every running
request decodes and none waits, one step runs several decodes back to back in the worker, each
fed the token the one before sampled (engine/sched/scheduler.py `_burst`, engine/worker/model_runner.py
`_run_burst`). The tokens are the one-step engine's. In process each step's tokens are published while
the next computes (engine/executor/streamed_burst.py); from a worker process a burst's come together."""

from __future__ import annotations

import dataclasses
import threading

import anyio
import pytest
import trio
import trio.testing

from engine import EngineConfig, open_engine
from engine.config import CPU_BURST_STEPS
from engine.executor.streamed_burst import StreamedBurst
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sched.block_manager import KVBlockManager
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.sched.request import RequestStatus
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.testing import FakeExecutor
from engine.worker.model_runner import ModelRunner
from tests.conftest import engine_config
from tests.helpers import greedy
from tests.test_scheduler import make_request

PROMPTS = [[5, 6, 7], list(range(40, 100)), [9] * 20, [11, 12]]


def burst_scheduler(steps=8, num_blocks=64, max_model_len=256):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len,
                             num_scheduler_steps=steps)
    return Scheduler(config, KVBlockManager(num_blocks, 4))


def land(sched, out, tokens):
    """The step's output: `tokens` (a list per step of the burst) for each request it sampled."""
    result = ModelRunnerOutput(sampled_token_ids={s.request_id: list(tokens[:out.num_steps])
                                                  for s in out.scheduled if s.sample})
    return sched.update_from_output(out, result)


def test_a_prompt_step_is_never_a_burst_and_decodes_burst_up_to_max_tokens():
    sched = burst_scheduler(steps=8)
    sched.add_request(make_request("a", n_prompt=6, max_tokens=11))
    prompt = sched.schedule()
    assert prompt.num_steps == 1
    land(sched, prompt, [50])
    burst = sched.schedule()
    assert burst.num_steps == 8 and burst.scheduled[0].token_ids == [50] and burst.scheduled[0].start_position == 6
    request = sched.requests["a"]
    assert sum(len(t) for t in burst.scheduled[0].block_tables) * 4 >= 6 + 8  # room for every decode of it
    [update] = land(sched, burst, range(60, 68))
    assert update.new_token_ids == list(range(60, 68)) and request.num_computed_tokens == 14
    last = sched.schedule()
    assert last.num_steps == 2  # 9 tokens so far: 2 left of max_tokens, never more
    [update] = land(sched, last, [70, 71])
    assert update.finished and request.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == 64


def test_an_eos_inside_a_burst_ends_the_request_there_and_drops_the_rest():
    sched = burst_scheduler(steps=4)
    sched.add_request(make_request("a", n_prompt=4, max_tokens=20, eos_token_ids=(3,)))
    land(sched, sched.schedule(), [50])
    burst = sched.schedule()
    [update] = land(sched, burst, [51, 3, 52, 53])
    assert update.new_token_ids == [51, 3] and update.finished
    assert "a" not in sched.requests and sched.kv.num_free_blocks == 64


@pytest.mark.parametrize("why", ["waiting", "structured", "context", "blocks"])
def test_no_burst_when_a_request_waits_needs_its_grammar_or_lacks_room(why):
    sched = burst_scheduler(steps=8, num_blocks=2 if why == "blocks" else 64,
                            max_model_len=11 if why == "context" else 256)
    params = {"structured_outputs": object()} if why == "structured" else {}
    sched.add_request(make_request("a", n_prompt=7, max_tokens=20, **params))
    land(sched, sched.schedule(), [50])
    if why == "waiting":  # and cannot be scheduled: the budget is gone after a's decode
        sched.add_request(make_request("b", n_prompt=60, max_tokens=4))
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=1)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]
    # 8 tokens of a context of 11: three more at most. Two blocks of 4 hold the prompt's 7 and one decode:
    # no burst fits, however short.
    assert out.num_steps == (3 if why == "context" else 1)
    land(sched, out, [60, 61, 62])


def test_a_burst_shortens_until_every_request_has_room_and_strands_no_blocks():
    """Room for a burst's decodes is taken for every request at once: where a burst of 8 would fit
    one request but not both, both get a burst of 4 (before, the first took blocks for 8, the
    second found none left, and the step ran one decode with those blocks stranded)."""
    sched = burst_scheduler(steps=8, num_blocks=5)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, n_prompt=4, max_tokens=20))
    land(sched, sched.schedule(), [50])  # both prompts: a block each, 3 free
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and out.num_steps == 4
    assert all(sum(len(t) for t in s.block_tables) * 4 >= 4 + 4 for s in out.scheduled)
    assert sched.kv.num_free_blocks == 1
    land(sched, out, range(60, 64))
    assert all(sched.requests[rid].num_computed_tokens == 8 for rid in ("a", "b"))


async def _run(config: EngineConfig, params: list[SamplingParams]) -> tuple[list[list[int]], list[int], int, list]:
    tokens: dict[int, list[int]] = {}
    outputs: dict[int, int] = {}
    logprobs: dict[int, list] = {}
    async with open_engine(config) as engine:
        async def run(i: int) -> None:
            got = [o async for o in engine.generate(PROMPTS[i], params[i])]
            tokens[i] = [t for o in got for t in o.outputs[0].token_ids]
            outputs[i] = len(got)
            entries = [entry for o in got for entry in o.outputs[0].logprobs or ()]
            logprobs[i] = [{t: e.logprob for t, e in entry.items()} for entry in entries]
        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
        steps = engine.core.num_steps
    return ([tokens[i] for i in range(len(PROMPTS))], [outputs[i] for i in range(len(PROMPTS))], steps,
            logprobs[1])


@pytest.mark.parametrize("executor", ["inproc", "mp"])
async def test_bursts_give_the_one_step_engines_tokens_and_logprobs(tiny_model_dir, executor):
    """Greedy, seeded sampling with logprobs and a penalty (which read the tokens sampled inside the
    burst), a stop token met mid-burst and max_tokens of 1: the tokens of the engine that runs one
    decode per step, in fewer steps (and, from a worker process, fewer outputs)."""
    delta = RequestOutputKind.DELTA
    params = [greedy(12, ignore_eos=True, output_kind=delta),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=2,
                             presence_penalty=1.5, output_kind=delta),
              greedy(1, ignore_eos=True, output_kind=delta), greedy(9, ignore_eos=True, output_kind=delta)]
    want, want_outputs, want_steps, want_logprobs = await _run(engine_config(tiny_model_dir, num_scheduler_steps=1),
                                                               params)
    params[0] = greedy(12, ignore_eos=True, stop_token_ids=[want[0][5]], output_kind=delta)  # its sixth token
    want[0] = want[0][:want[0].index(want[0][5]) + 1]
    got, outputs, steps, logprobs = await _run(engine_config(tiny_model_dir, num_scheduler_steps=4, executor=executor),
                                               params)
    assert got == want
    assert len(logprobs) == 10 and [list(e) for e in logprobs] == [list(e) for e in want_logprobs]
    flat = [value for entry in logprobs for value in entry.values()]
    assert flat == pytest.approx([value for entry in want_logprobs for value in entry.values()], abs=1e-4)
    assert steps < want_steps
    if executor == "mp":  # a worker process returns a burst whole; in process its tokens stream step by step
        assert sum(outputs) < sum(want_outputs)


async def test_a_stop_string_inside_a_burst_keeps_no_token_after_it(tiny_model_dir):
    config = engine_config(tiny_model_dir, num_scheduler_steps=1)
    async with open_engine(config) as engine:
        plain = [o async for o in engine.generate(PROMPTS[1], greedy(16, ignore_eos=True))][-1].outputs[0]
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 2]
    params = greedy(16, ignore_eos=True, stop=[stop])
    async with open_engine(config) as engine:
        want = [o async for o in engine.generate(PROMPTS[1], params)][-1].outputs[0]
    async with open_engine(engine_config(tiny_model_dir, num_scheduler_steps=8)) as engine:
        got = [o async for o in engine.generate(PROMPTS[1], params)][-1].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < len(plain.token_ids)
    assert (got.text, list(got.token_ids), got.stop_reason) == (want.text, list(want.token_ids), want.stop_reason)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_request_that_arrives_during_a_burst_waits_for_it_alone(tiny_model_dir, autojump_clock):
    """Each decode of the fake executor takes 10 ms (virtual): a request arriving 15 ms into an
    8-decode burst starts at the burst's end (80 ms), and the steps after it are single decodes
    while its prompt is scheduled."""
    executor = FakeExecutor(step_time=0.01)
    async with open_engine(engine_config(tiny_model_dir, num_scheduler_steps=8), executor=executor) as engine:
        started: dict[str, float] = {}

        async def run(rid: str, prompt: list[int], max_tokens: int) -> None:
            async for _ in engine.generate(prompt, greedy(max_tokens, ignore_eos=True), request_id=rid):
                started.setdefault(rid, trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", [1, 2, 3], 40)
            await trio.sleep(0.025)  # the prompt's step (10 ms), then 15 ms into the first burst
            nursery.start_soon(run, "b", [4, 5], 3)
    steps = [s.num_steps for s in executor.steps]
    assert steps[:2] == [1, 8]
    b_prompt = next(i for i, s in enumerate(executor.steps) if any(r.request_id == "b" for r in s.scheduled))
    assert b_prompt == 2 and started["b"] - started["a"] == pytest.approx(0.08 + 0.01)


def test_num_scheduler_steps_is_refused_with_async_scheduling_or_several_workers(tiny_model_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(model=tiny_model_dir, num_scheduler_steps=4, async_scheduling=True)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(model=tiny_model_dir, num_scheduler_steps=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(model=tiny_model_dir, num_scheduler_steps=0)
    assert not EngineConfig(model=tiny_model_dir, device="cuda", num_scheduler_steps=4).schedules_async


def test_bursts_are_the_default_on_cpu_where_their_tokens_stream(tiny_model_dir):
    """Unset, `num_scheduler_steps` is CPU_BURST_STEPS on CPU when the executor streams a burst's
    tokens as they are sampled (in process) and steps are not scheduled ahead; else 1. A value given wins."""
    config = EngineConfig(model=tiny_model_dir)
    assert config.num_scheduler_steps is None
    assert config.scheduler_steps(streams_bursts=True) == CPU_BURST_STEPS > 1
    assert config.scheduler_steps(streams_bursts=False) == 1  # a worker process: tokens a burst at a time
    assert EngineConfig(model=tiny_model_dir, async_scheduling=True).scheduler_steps(streams_bursts=True) == 1
    assert EngineConfig(model=tiny_model_dir, device="cuda").scheduler_steps(streams_bursts=True) == 1
    assert EngineConfig(model=tiny_model_dir, num_scheduler_steps=1).scheduler_steps(streams_bursts=True) == 1
    assert EngineConfig(model=tiny_model_dir, num_scheduler_steps=3).scheduler_steps(streams_bursts=False) == 3


async def test_a_default_engine_in_process_decodes_in_bursts_and_a_fake_executor_one_step_at_a_time(tiny_model_dir):
    """The in-process executor streams bursts, so a default CPU engine runs them: 1 + 2 x
    CPU_BURST_STEPS tokens in three steps (the prompt's, then two whole bursts). The fake executor
    returns a burst whole, so tests driving it in virtual time keep one decode a step unless they
    ask for bursts."""
    wanted = 1 + 2 * CPU_BURST_STEPS
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        assert engine.core.executor.streams_bursts
        assert engine.core.scheduler.config.num_scheduler_steps == CPU_BURST_STEPS
        tokens = [t async for o in engine.generate(PROMPTS[0], greedy(wanted, ignore_eos=True,
                                                                     output_kind=RequestOutputKind.DELTA))
                  for t in o.outputs[0].token_ids]
        await engine.core.wait_until_idle()  # the last burst's thread has returned
        assert len(tokens) == wanted and engine.core.num_steps == 3
    executor = FakeExecutor()
    async with open_engine(engine_config(tiny_model_dir), executor=executor) as engine:
        assert not executor.streams_bursts and engine.core.scheduler.config.num_scheduler_steps == 1


# ---- in process, a burst's tokens stream step by step (engine/executor/streamed_burst.py) ----------

def _burst_of(steps: int, gates: list[threading.Event]):
    """A stand-in for `Worker.execute_model`: step k > 0 computes until `gates[k]` is set; each
    step's token is k; the burst goes on while `on_step` says so, as the model runner's does."""
    def execute(sched_out, on_step):
        out = ModelRunnerOutput()
        going = on_step(ModelRunnerOutput(sampled_token_ids={"a": [0]}))
        for k in range(1, steps):
            if not going:
                break
            assert gates[k].wait(timeout=30)
            out.steps_run += 1
            going = on_step(ModelRunnerOutput(sampled_token_ids={"a": [k]}))
        return out
    return execute


async def test_a_streamed_burst_hands_over_each_step_while_the_next_computes_and_stops_when_told():
    gates = [threading.Event() for _ in range(6)]
    burst = StreamedBurst(_burst_of(6, gates), SchedulerOutput(num_steps=6), anyio.CapacityLimiter(1))
    seen: list[int] = []
    arrived = [trio.Event() for _ in range(6)]

    def on_step(step: ModelRunnerOutput) -> bool:
        (token,) = step.sampled_token_ids["a"]
        seen.append(token)
        arrived[token].set()
        return token < 1  # the consumer asks to stop after step 1's tokens

    async with trio.open_nursery() as nursery:
        result: list[ModelRunnerOutput] = []
        nursery.start_soon(lambda: _collect(burst.run(on_step), result))
        await arrived[0].wait()
        assert seen == [0] and not gates[1].is_set()  # step 0's token is out while step 1 computes
        gates[1].set()
        await arrived[1].wait()  # the consumer said stop here: the step in flight (2) is the last
        gates[2].set()
    assert seen == [0, 1, 2] and result[0].steps_run == 3 and not any(g.is_set() for g in gates[3:])


async def _collect(awaitable, into: list) -> None:
    into.append(await awaitable)


async def test_a_cancelled_streamed_burst_ends_after_the_step_in_flight():
    gates = [threading.Event() for _ in range(4)]
    burst = StreamedBurst(_burst_of(4, gates), SchedulerOutput(num_steps=4), anyio.CapacityLimiter(1))
    arrived = trio.Event()

    def on_step(step: ModelRunnerOutput) -> bool:
        arrived.set()
        return True

    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await burst.run(on_step)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await arrived.wait()
        scope.cancel()  # the burst's task waits for the thread, which is in step 1
        await trio.testing.wait_all_tasks_blocked()  # the cancellation has reached the burst
        gates[1].set()
    assert scope.cancelled_caught and not gates[2].is_set()  # it stopped after step 1: step 2 never waited


async def test_a_consumer_that_raises_stops_the_burst_and_its_error_comes_out_of_run():
    """`on_step` runs in a `run_sync_soon` callback, where an exception would end trio's run: it is
    kept, the burst stops after the step in flight (whose tokens are dropped), and `run` raises it
    once the thread has returned."""
    gates = [threading.Event() for _ in range(4)]
    burst = StreamedBurst(_burst_of(4, gates), SchedulerOutput(num_steps=4), anyio.CapacityLimiter(1))
    seen: list[int] = []
    raised = trio.Event()

    def on_step(step: ModelRunnerOutput) -> bool:
        (token,) = step.sampled_token_ids["a"]
        seen.append(token)
        if token == 1:
            raised.set()
            raise LookupError("no such request")
        return True

    async def run() -> None:
        with pytest.raises(LookupError, match="no such request"):
            await burst.run(on_step)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        gates[1].set()
        await raised.wait()
        gates[2].set()  # the step in flight when the consumer raised: the worker stops after it
    assert seen == [0, 1] and not gates[3].is_set()


async def test_in_process_a_message_ends_a_streamed_burst_at_the_next_step(tiny_model_dir, monkeypatch):
    """A request's burst of up to 64 decodes is held in its third step until a second request has
    been submitted; the core, seeing the message with that step's tokens, tells the worker to stop,
    and the worker stops after the step in flight (the fourth: held until the core has told it, as
    a busy machine may schedule the loop late, and the worker does not wait for the loop); the
    second request's prompt runs long before the first request's 64 tokens are done."""
    hold, held, stopped = threading.Event(), threading.Event(), threading.Event()
    steps_run: list[int] = []
    execute, run_burst = ModelRunner.execute, StreamedBurst.run

    def held_execute(self, sched_out, on_step=None):
        if on_step is None:
            return execute(self, sched_out)
        calls = 0

        def step(tokens):
            nonlocal calls
            calls += 1
            if calls == 3:
                held.set()
                assert hold.wait(timeout=30)
            if calls == 4:
                assert stopped.wait(timeout=30)
            return on_step(tokens)
        out = execute(self, sched_out, step)
        steps_run.append(out.steps_run)
        return out

    async def watched_run(self, on_step):
        def watched(step):
            going = on_step(step)
            if not going:
                self._going = False  # what the burst's consumer does next, before the worker may look
                stopped.set()
            return going
        return await run_burst(self, watched)

    monkeypatch.setattr(ModelRunner, "execute", held_execute)
    monkeypatch.setattr(StreamedBurst, "run", watched_run)
    order: list[str] = []
    async with open_engine(engine_config(tiny_model_dir, num_scheduler_steps=64)) as engine:
        async def run(rid: str, prompt: list[int], max_tokens: int) -> None:
            async for output in engine.generate(prompt, greedy(max_tokens, ignore_eos=True), request_id=rid):
                order.append(rid)
                if rid == "a" and output.finished:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", [1, 2, 3], 66)
            await trio.to_thread.run_sync(held.wait)
            await trio.testing.wait_all_tasks_blocked()  # the first two steps' tokens consumed, before b
            nursery.start_soon(run, "b", [4, 5], 2)
            await trio.testing.wait_all_tasks_blocked()  # b's request is in the core's inbox
            assert engine.core.num_pending_messages == 1
            hold.set()
    assert steps_run[0] == 4  # three steps, and the one in flight when the core told the worker
    assert order.index("b") < len(order) - 40  # b's first token came while a had most of its own to go
