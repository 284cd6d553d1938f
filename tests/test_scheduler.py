"""Scheduler: continuous batching, chunked prefill, preemption, policies, gates, abort. Plain sync tests."""

import collections
import random
import zlib

import pytest

from engine.sampling_params import SamplingParams
from engine.sched.block_manager import KVBlockManager
from engine.sched.output import PLACEHOLDER_TOKEN, ModelRunnerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Admission, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, policy="fcfs", gates=(),
                   max_model_len=256, chunked=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, policy=policy, enable_chunked_prefill=chunked)
    return Scheduler(config, KVBlockManager(num_blocks, block_size), gates)


def make_request(rid, n_prompt=8, max_tokens=4, priority=0, arrival=0.0, first_token=None, **params):
    """Prompts of different ids differ, so only tests that want prefix-cache hits get them."""
    first = zlib.crc32(rid.encode()) % 100_000 * 100 if first_token is None else first_token
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority, max_tokens=max_tokens)


def run_step(sched, token=7):
    """Schedule, pretend the model sampled `token` for each request that samples, update."""
    out = sched.schedule()
    result = ModelRunnerOutput(sampled_token_ids={s.request_id: [token] for s in out.scheduled if s.sample})
    return out, sched.update_from_output(out, result)


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", n_prompt=8, max_tokens=3))
    out, updates = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled] == [("a", 8, 0)]
    assert updates[0].new_token_ids == [7]
    out, _ = run_step(sched)
    assert [(s.num_tokens, s.start_position) for s in out.scheduled] == [(1, 8)]
    _, updates = run_step(sched)
    assert updates[0].finished and updates[0].request.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_work() and sched.kv.num_used_blocks == 0


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("short", n_prompt=4, max_tokens=10))
    run_step(sched)  # short prefilled
    sched.add_request(make_request("long", n_prompt=20))
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [("short", 1, True), ("long", 9, False)]
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled] == [("short", 1, 5), ("long", 9, 9)]
    out, updates = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [("short", 1, True), ("long", 2, True)]
    assert {u.request.request_id for u in updates} == {"short", "long"}


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_request(make_request("big", n_prompt=12))
    assert sched.schedule().is_empty


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", n_prompt=4))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens: two requests of 8 tokens fill the cache; the first decode needs a 5th block.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("old", n_prompt=8, max_tokens=8))
    sched.add_request(make_request("new", n_prompt=8, max_tokens=8))
    run_step(sched)
    assert sched.kv.num_free_blocks == 0
    out, _ = run_step(sched)
    victim = sched.requests["new"]
    assert [s.request_id for s in out.scheduled] == ["old"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and list(sched.waiting) == [victim]
    # Once "old" finishes, "new" is recomputed from all its tokens (prompt + the one it sampled).
    while "old" in sched.requests:
        run_step(sched)
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled] == [("new", 9, 0)]


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, policy="priority")
    sched.add_request(make_request("low", n_prompt=8, priority=5, arrival=0.0, max_tokens=8))
    sched.add_request(make_request("high", n_prompt=8, priority=0, arrival=1.0, max_tokens=8))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["high", "low"]
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["high"]
    assert sched.requests["low"].status == RequestStatus.PREEMPTED


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", n_prompt=12, max_tokens=1, first_token=0))
    run_step(sched)
    sched.add_request(make_request("b", n_prompt=12, max_tokens=2, first_token=0))
    out, _ = run_step(sched)
    assert [(s.num_tokens, s.start_position) for s in out.scheduled] == [(4, 8)]
    assert sched.requests["b"].num_cached_tokens == 8


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("running"))
    sched.add_request(make_request("waiting"))
    run_step(sched)
    aborted = sched.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == {"running", "waiting"}
    assert not sched.has_work() and sched.kv.num_used_blocks == 0
    # No step runs for an empty schedule: the worker hears of it with the next step that does.
    assert sched.schedule().finished_request_ids == []
    sched.add_request(make_request("next"))
    assert sched.schedule().finished_request_ids == ["running"]  # the worker forgets it


class Gate:
    def __init__(self):
        self.verdicts = {}

    def admit(self, request):
        return self.verdicts.get(request.request_id, Admission.READY)


def test_not_yet_defers_for_one_step_without_consuming_budget_and_keeps_its_place():
    gate = Gate()
    sched = make_scheduler(budget=8, gates=[gate])
    for rid in ("first", "second"):
        sched.add_request(make_request(rid, n_prompt=8))
    gate.verdicts["first"] = Admission.NOT_YET
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["second"]  # the whole budget went to the one behind
    assert [r.request_id for r in sched.waiting] == ["first"] and not sched.step_skipped_waiting
    gate.verdicts["first"] = Admission.READY
    out, _ = run_step(sched)
    assert "first" in [s.request_id for s in out.scheduled]


def test_blocked_requests_park_in_skipped_waiting_until_the_gate_opens():
    gate = Gate()
    sched = make_scheduler(gates=[gate])
    sched.add_request(make_request("blocked"))
    sched.add_request(make_request("later"))
    gate.verdicts["blocked"] = Admission.BLOCKED
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["later"]
    assert [r.request_id for r in sched.skipped_waiting] == ["blocked"]
    run_step(sched)  # still blocked: asked again, stays parked
    assert sched.num_waiting == 1
    gate.verdicts["blocked"] = Admission.READY
    out, _ = run_step(sched)
    assert "blocked" in [s.request_id for s in out.scheduled] and not sched.skipped_waiting


def test_stop_conditions_eos_stop_token_min_tokens():
    sched = make_scheduler()
    sched.add_request(Request("eos", [1, 2], SamplingParams(max_tokens=10).with_eos((7,)), max_tokens=10))
    sched.add_request(Request("min", [1, 2], SamplingParams(max_tokens=10, min_tokens=2).with_eos((7,)), max_tokens=10))
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True).with_eos((7,))
    sched.add_request(Request("ign", [1, 2], ignoring, max_tokens=3))
    _, updates = run_step(sched, token=7)
    assert {u.request.request_id for u in updates if u.finished} == {"eos"}
    _, updates = run_step(sched, token=7)
    assert {u.request.request_id for u in updates if u.finished} == {"min"}
    _, updates = run_step(sched, token=7)
    assert [u.request.status for u in updates if u.finished] == [RequestStatus.FINISHED_LENGTH]


def test_stop_token_ids_set_stop_reason_and_context_length_caps():
    sched = make_scheduler(max_model_len=10)
    sched.add_request(Request("stop", [1, 2], SamplingParams(stop_token_ids=[9]), max_tokens=16))
    sched.add_request(Request("ctx", list(range(9)), SamplingParams(), max_tokens=16))
    _, updates = run_step(sched, token=9)
    by_id = {u.request.request_id: u.request for u in updates}
    assert by_id["stop"].stop_reason == 9 and by_id["stop"].status == RequestStatus.FINISHED_STOPPED
    assert by_id["ctx"].status == RequestStatus.FINISHED_LENGTH


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a"))


def test_steps_in_flight_split_the_running_batch_and_are_never_rescheduled_or_preempted():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, micro_batches=2)
    sched = Scheduler(config, KVBlockManager(64, 4))
    for rid in "abcd":
        sched.add_request(make_request(rid, n_prompt=4, max_tokens=8))
    run_step(sched)  # the four prefills, one step
    first = sched.schedule()
    second = sched.schedule()  # the first step's output is not back yet
    assert len(first.scheduled) == len(second.scheduled) == 2  # each its half of the running batch
    assert {s.request_id for s in first.scheduled}.isdisjoint(s.request_id for s in second.scheduled)
    assert sched.schedule().is_empty  # every running request is in flight
    assert sched._pick_victim() is None  # nor can one be preempted: its step still uses its blocks
    result = ModelRunnerOutput(sampled_token_ids={s.request_id: [7] for s in first.scheduled})
    sched.update_from_output(first, result)
    again = sched.schedule()
    assert {s.request_id for s in again.scheduled} == {s.request_id for s in first.scheduled}


def async_scheduler(**options):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, async_scheduling=True,
                             **options)
    return Scheduler(config, KVBlockManager(64, 4))


def land(sched, out, token):
    """The step `out`'s output comes back: `token` for each request it sampled."""
    return sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={s.request_id: [token]
                                                                              for s in out.scheduled if s.sample}))


def test_async_scheduling_decodes_one_step_ahead_on_the_token_in_flight_and_stops_at_max_tokens():
    """Each step is scheduled while the one before is in flight, its input the placeholder of the
    token that step samples; never two steps ahead, and never a step past max_tokens."""
    sched = async_scheduler()
    sched.add_request(make_request("a", n_prompt=8, max_tokens=4))
    first = sched.schedule()  # the prompt
    second = sched.schedule()  # while the prompt is in flight
    assert [(s.token_ids, s.start_position, s.sample) for s in second.scheduled] == [([PLACEHOLDER_TOKEN], 8, True)]
    assert sched.schedule().is_empty  # one step ahead at most
    assert sched._pick_victim() is None  # in flight: never preempted
    assert land(sched, first, 101)[0].new_token_ids == [101]
    third = sched.schedule()
    assert [(s.start_position, s.token_ids) for s in third.scheduled] == [(9, [PLACEHOLDER_TOKEN])]
    land(sched, second, 102)
    fourth = sched.schedule()
    assert [s.start_position for s in fourth.scheduled] == [10]
    land(sched, third, 103)
    assert sched.schedule().is_empty  # the step in flight samples the fourth and last token
    (update,) = land(sched, fourth, 104)
    assert update.finished and update.request.output_token_ids == [101, 102, 103, 104]
    assert not sched.has_work() and sched.kv.num_used_blocks == 0


def test_async_scheduling_drops_the_step_ahead_of_a_request_that_stopped():
    """A request ends on EOS in the step in flight: the step ahead's token is dropped, its blocks
    are free, and the worker hears it finished with the next step."""
    sched = async_scheduler()
    sched.add_request(make_request("a", n_prompt=4, max_tokens=10, eos_token_ids=(2,)))
    sched.add_request(make_request("b", n_prompt=4, max_tokens=10))
    first = sched.schedule()
    ahead = sched.schedule()
    (stopped, _) = land(sched, first, 2)  # EOS for both; b ignores it
    assert stopped.finished and stopped.request.output_token_ids == [2]
    assert [u.request.request_id for u in land(sched, ahead, 5)] == ["b"]
    assert sched.schedule().finished_request_ids == ["a"]
    assert sched.kv.block_ids("a") == []


@pytest.mark.parametrize("seed", range(6))
def test_async_scheduling_keeps_the_accounting_over_random_workloads_and_tokens_in_order(seed):
    """Two steps in flight at all times, random arrivals, aborts and tight blocks: the block
    accounting stays exact and each request's tokens arrive in the order its steps sampled them."""
    from tests.test_scheduler_invariants import check_block_accounting
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=rng.choice([16, 64]), max_model_len=128,
                             async_scheduling=True)
    sched = Scheduler(config, KVBlockManager(rng.choice([24, 48]), 4))
    pending: collections.deque = collections.deque()
    sent: dict[str, list[int]] = collections.defaultdict(list)  # tokens sampled per request, in step order
    ahead_steps = 0
    for step in range(400):
        if step < 300 and rng.random() < 0.4:
            max_tokens = rng.randrange(1, 20)
            sched.add_request(make_request(f"r{step}", n_prompt=rng.randrange(1, 24), max_tokens=max_tokens,
                                           eos_token_ids=(3,)))
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        ahead_steps += any(s.token_ids == [PLACEHOLDER_TOKEN] for s in out.scheduled)
        pending.append(out)
        if len(pending) == 2 or (pending and out.is_empty):
            oldest = pending.popleft()
            tokens = {s.request_id: rng.choice([3, 50, 60, 70]) for s in oldest.scheduled if s.sample}
            for rid, token in tokens.items():
                sent[rid].append(token)
            sched.update_from_output(oldest, ModelRunnerOutput(sampled_token_ids={r: [t] for r, t in tokens.items()}))
            check_block_accounting(sched)
        for request in sched.running:
            assert request.output_token_ids == sent[request.request_id][:len(request.output_token_ids)]
    while pending:
        sched.update_from_output(pending.popleft(), ModelRunnerOutput())
    assert ahead_steps > 50
