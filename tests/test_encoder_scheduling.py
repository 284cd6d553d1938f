"""The scheduler with images: the encoder budget and cache decide how far a chunk goes, cached
encoder outputs are shared, evictions reach the worker. Plain sync tests."""

from engine.mm_features import ImageFeature
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import KVBlockManager
from engine.sched.encoder_cache import EncoderCacheManager
from engine.sched.output import ModelRunnerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig


def make_scheduler(budget=64, encoder_rows=20, cache_rows=20):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512,
                             encoder_budget_rows=encoder_rows, encoder_cache_rows=cache_rows)
    return Scheduler(config, KVBlockManager(128, 4, enable_prefix_caching=False))


def image_request(rid, images: list[tuple[str, int]], text=4, rows=10, max_tokens=2):
    """`text` tokens, then each image (hash, rows) followed by `text` tokens."""
    tokens, features = list(range(text)), []
    for mm_hash, length in images:
        features.append(ImageFeature(mm_hash, len(tokens), length))
        tokens += [999] * length + list(range(text))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, mm_features=features)


def step(sched):
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={s.request_id: [7] for s in out.scheduled
                                                                      if s.sample}))
    return out


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take():
    sched = make_scheduler(encoder_rows=20, cache_rows=40)
    sched.add_request(image_request("a", [("x", 15), ("y", 15)]))  # 4 + 15 + 4 + 15 + 4 tokens
    out = step(sched)
    assert [(s.request_id, s.start_position, s.num_tokens) for s in out.scheduled] == [("a", 0, 23)]
    assert out.encoder_inputs == {"a": [0]}  # y would pass the 20-row budget: the chunk ends before it
    out = step(sched)
    assert out.encoder_inputs == {"a": [1]} and out.scheduled[0].start_position == 23


def test_a_text_request_behind_a_blocked_image_is_scheduled():
    sched = make_scheduler(encoder_rows=20, cache_rows=20)
    sched.add_request(image_request("a", [("x", 15)], text=0))  # the image comes first: nothing can run yet...
    sched.encoder_cache.allocate("other", 10, "someone")  # ...while the cache is held by another reader
    sched.add_request(Request("t", list(range(8)), SamplingParams(max_tokens=2), max_tokens=2))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["t"]
    assert out.encoder_inputs == {}


def test_requests_with_the_same_image_share_one_encoding():
    sched = make_scheduler(encoder_rows=20, cache_rows=20)
    sched.add_request(image_request("a", [("x", 15)]))
    sched.add_request(image_request("b", [("x", 15)]))
    out = step(sched)
    assert out.encoder_inputs == {"a": [0]}  # b reads what a's encoding puts in the cache
    assert {s.request_id for s in out.scheduled} == {"a", "b"}
    assert sched.encoder_cache.refs["x"] == set()  # both passed the image: freeable, still cached
    assert "x" in sched.encoder_cache.freeable and sched.encoder_cache.hits == 1


def test_freeable_entries_are_evicted_oldest_first_and_the_worker_is_told():
    sched = make_scheduler(encoder_rows=20, cache_rows=20)
    sched.add_request(image_request("a", [("x", 15)]))
    step(sched)
    sched.add_request(image_request("b", [("y", 15)]))
    out = step(sched)
    assert out.encoder_inputs == {"b": [0]}
    assert out.freed_encoder_hashes == ["x"]  # x was freeable; y needed its room
    assert sched.encoder_cache.has("y") and not sched.encoder_cache.has("x")


def test_aborting_releases_the_image_reference():
    sched = make_scheduler(budget=8, encoder_rows=20, cache_rows=20)
    sched.add_request(image_request("a", [("x", 15)]))
    step(sched)  # 8 tokens: the image is half computed
    assert sched.encoder_cache.refs["x"] == {"a"}
    from engine.sched.request import RequestStatus
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.encoder_cache.refs["x"] == set() and "x" in sched.encoder_cache.freeable


def test_cache_manager_never_counts_what_the_caller_reads_as_room():
    cache = EncoderCacheManager(20)
    cache.allocate("x", 15, "a")
    cache.release("x", "a")
    assert cache.can_allocate(20)
    assert not cache.can_allocate(20, keep={"x"})
