"""Randomized runs of the scheduler over a tight KV cache, checking the block accounting after every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.sampling_params import SamplingParams
from engine.sched.block_manager import KVBlockManager
from engine.sched.output import ModelRunnerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler, SchedulerConfig


def check_block_accounting(sched: Scheduler) -> None:
    kv = sched.kv
    held = Counter()
    for rid in sched.requests:
        held.update(kv.block_ids(rid))
    for block in kv._blocks:
        assert block.ref_cnt == held[block.block_id], f"block {block.block_id} refcount drifted"
        assert (block.ref_cnt == 0) == (block.block_id in kv._free)
    for request in sched.running:
        needed = kv.blocks_needed(request.num_computed_tokens)
        assert len(kv.block_ids(request.request_id)) >= needed
    for request in sched.waiting:
        assert request.num_computed_tokens == 0 and not kv.block_ids(request.request_id)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_keeps_block_accounting_exact(seed, policy):
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=rng.choice([4, 8, 16]), max_num_batched_tokens=rng.choice([16, 64, 256]),
                             max_model_len=512, policy=policy)
    sched = Scheduler(config, KVBlockManager(num_blocks=rng.choice([24, 48]), block_size=4))
    shared_prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    finished = aborted = 0
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(shared_prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            max_tokens = rng.randrange(1, 40)
            sched.add_request(Request(f"r{step}-{rng.random()}", prompt, SamplingParams(max_tokens=max_tokens),
                                      arrival_time=step, priority=rng.randrange(3), max_tokens=max_tokens))
        if sched.requests and rng.random() < 0.1:
            victim = rng.choice(list(sched.requests))
            aborted += len(sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED))
        out = sched.schedule()
        assert out.total_num_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        result = ModelRunnerOutput(sampled_token_ids={s.request_id: [rng.randrange(1000)]
                                                      for s in out.scheduled if s.sample})
        finished += sum(u.finished for u in sched.update_from_output(out, result))
        check_block_accounting(sched)
    while sched.has_work():  # drain: everything finishes, nothing is stuck
        out = sched.schedule()
        assert not out.is_empty, "work left but nothing schedulable"
        result = ModelRunnerOutput(sampled_token_ids={s.request_id: [1] for s in out.scheduled if s.sample})
        finished += sum(u.finished for u in sched.update_from_output(out, result))
        check_block_accounting(sched)
    assert finished > 10 and aborted > 0 and sched.kv.num_used_blocks == 0
