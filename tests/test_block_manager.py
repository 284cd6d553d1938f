"""KV block manager: allocation, reference counts, prefix caching, eviction. Plain sync tests."""

from engine.sampling_params import SamplingParams
from engine.sched.block_manager import KVBlockManager
from engine.sched.request import Request


def make_request(rid: str, tokens: list[int], cache_key=None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_key=cache_key)


def compute_all(kv: KVBlockManager, req: Request) -> None:
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - cached.num_blocks * kv.block_size, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_allocates_blocks_for_tokens_and_frees_them():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10)
    assert len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 5
    kv.free(req)
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []


def test_blocks_are_made_when_first_taken_in_id_order_and_freed_ones_come_after():
    """A GPU's cache holds ~10^6 blocks: none is made until taken. Blocks never taken go first,
    in id order; then the freed ones, in the order they were freed (a table last block first; prefix caching off, so the
    freed blocks hold nothing worth keeping)."""
    kv = KVBlockManager(num_blocks=1_000_000, block_size=4, enable_prefix_caching=False)
    assert kv.num_free_blocks == 1_000_000 and kv.num_used_blocks == 0 and not kv._blocks
    a, b = make_request("a", list(range(8))), make_request("b", list(range(4)))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 4)
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2] and len(kv._blocks) == 3
    assert kv.num_free_blocks == 999_997
    small = KVBlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    first, second = make_request("a", list(range(8))), make_request("b", list(range(4)))
    assert small.allocate_slots(first, 8) and small.allocate_slots(second, 4) and small.num_free_blocks == 0
    small.free(second)
    small.free(first)
    third = make_request("c", list(range(12)))
    assert small.allocate_slots(third, 12)
    assert small.block_ids("c") == [2, 1, 0]  # freed order: b's block, then a's (its last first)


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVBlockManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_growing_a_sequence_takes_a_new_block_only_at_block_boundaries():
    kv = KVBlockManager(num_blocks=4, block_size=4)
    req = make_request("a", list(range(4)))
    assert kv.allocate_slots(req, 4)
    req.num_computed_tokens = 4
    req.append_output_token(99)
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids("a")) == 2
    req.num_computed_tokens = 5
    req.append_output_token(98)
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids("a")) == 2


def test_shared_prefix_is_computed_once_and_reference_counted():
    kv = KVBlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    a = make_request("a", system + [1, 2])
    compute_all(kv, a)
    b = make_request("b", system + [3, 4, 5])
    hits = kv.find_cached_prefix(b)
    assert hits.block_ids() == kv.block_ids("a")[:3]
    assert kv.allocate_slots(b, b.num_tokens - 12, hits)
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    assert all(blk.ref_cnt == 2 for blk in hits.tables[0])
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in hits.tables[0])
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_cached_blocks_survive_free_until_reused():
    kv = KVBlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    compute_all(kv, a)
    kv.free(a)
    assert kv.usage == 0.0  # blocks kept only by the prefix cache count as free
    again = make_request("again", list(range(9)))
    assert kv.find_cached_prefix(again).num_blocks == 2
    # Filling the cache with other tokens evicts them.
    other = make_request("other", list(range(50, 66)))
    assert kv.allocate_slots(other, 16)
    assert kv.find_cached_prefix(make_request("late", list(range(9)))).num_blocks == 0


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    compute_all(kv, a)
    b = make_request("b", list(range(8)))
    assert kv.find_cached_prefix(b).num_blocks == 1  # 7 of 8 tokens at most: one full block


def test_cache_key_separates_namespaces():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    compute_all(kv, make_request("a", list(range(9))))
    assert kv.find_cached_prefix(make_request("b", list(range(9)), cache_key="embeds")).num_blocks == 0
    assert kv.find_cached_prefix(make_request("c", list(range(9)))).num_blocks == 2


def test_prefix_caching_disabled_never_hits():
    kv = KVBlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute_all(kv, make_request("a", list(range(9))))
    assert kv.find_cached_prefix(make_request("b", list(range(9)))).num_blocks == 0


def test_with_a_sliding_window_a_long_sequence_holds_a_windows_worth_of_blocks():
    """Window 6, blocks of 4: the token at position p attends to p - 5 .. p, so once a request has
    computed n tokens its blocks wholly before n - 5 are released; their ids stay in its table (the
    worker masks them), another request may reuse them, and freeing the request frees the rest."""
    kv = KVBlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True, group_windows=(6,))
    req = make_request("a", list(range(8)))
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kv.cache_computed_blocks(req)
    held = []
    for _ in range(32):  # decode to 40 tokens, one at a time: 10 blocks' worth in a 6-block cache
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_computed_blocks(req)
        held.append(kv.num_used_blocks)
    assert len(kv.block_ids("a")) == 10 and max(held) <= 3  # the window's two blocks and the one being filled
    other = make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(other, 12)  # fits only in blocks "a" released
    assert set(kv.block_ids("b")) & set(kv.block_ids("a")[:7])
    kv.free(req)
    kv.free(other)
    assert kv.num_free_blocks == 6
    full = KVBlockManager(num_blocks=6, block_size=4)  # the same without a window runs out
    long = make_request("c", list(range(25)))
    assert not full.allocate_slots(long, 25)
