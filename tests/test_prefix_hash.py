"""Prefix-cache identities are cryptographic, namespaced, salted, and checked on every hit."""

from __future__ import annotations

import pytest
import trio.testing

from engine import SamplingParams, open_engine
from engine.config import HASH_ALGOS
from engine.sched.block_manager import KVBlockManager
from engine.sched.prefix_hash import PrefixHasher
from engine.sched.request import Request
from engine.testing import FakeExecutor
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


@pytest.mark.parametrize("algo, size", [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxhash_cbor", 16)])
def test_every_algorithm_chains_tokens_and_parent(algo, size):
    hasher = PrefixHasher(algo, b"model-a")
    block = hasher.block(hasher.root, [1, 2, 3, 4])
    assert len(block) == size and block == PrefixHasher(algo, b"model-a").block(hasher.root, [1, 2, 3, 4])
    assert block != hasher.block(hasher.root, [1, 2, 3, 5])  # the tokens
    assert block != hasher.block(hasher.block(hasher.root, [9]), [1, 2, 3, 4])  # the parent
    other_model = PrefixHasher(algo, b"model-b")
    assert other_model.block(other_model.root, [1, 2, 3, 4]) != block  # the namespace
    assert hasher.request_root(("cache_salt", "x")) != hasher.request_root(("cache_salt", "y")) != hasher.root


def test_an_unknown_algorithm_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="one of sha256, sha256_cbor, xxhash, xxhash_cbor"):
        PrefixHasher("md5")
    assert set(HASH_ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}


class CollidingHasher(PrefixHasher):
    """Every block gets the same hash: the worst a weak hash could do."""

    def block(self, parent, tokens):
        return b"\0" * 32


def _request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def test_a_forced_hash_collision_never_shares_blocks():
    kv = KVBlockManager(16, 4, hasher=CollidingHasher())
    first = _request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_computed_blocks(first)
    other = _request("other", [10, 11, 12, 13, 14, 15, 16, 17, 18])
    assert kv.find_cached_prefix(other).num_blocks == 0 and kv.num_collisions == 1
    same = _request("same", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.find_cached_prefix(same).num_blocks == 1  # a true hit still hits (the second block's parent differs)


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_requests_with_different_salts_never_share_blocks(tiny_model_dir, autojump_clock):
    ids = list(range(1, 41))  # two full 16-token blocks can be reused
    async with open_engine(engine_config(tiny_model_dir), executor=FakeExecutor()) as engine:
        await final_output(engine, {"prompt_token_ids": ids, "cache_salt": "alice"}, greedy(2))
        await final_output(engine, {"prompt_token_ids": ids, "cache_salt": "bob"}, greedy(2))
        await final_output(engine, ids, greedy(2))  # no salt: its own namespace too
        assert engine.stats().prefix_cache_hits == 0
        await final_output(engine, {"prompt_token_ids": ids, "cache_salt": "alice"}, greedy(2))
        assert engine.stats().prefix_cache_hits == 32
