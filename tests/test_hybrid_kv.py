"""The hybrid KV cache (engine/kv_groups.py): layers grouped by window, a block table per group in
the block manager, the blocks behind a sliding group's window released while the full groups keep
theirs, prefix hits across groups; and an engine serving Gemma 3 in less cache than one table
would need, token for token with transformers, eager and on captured decode graphs."""

from __future__ import annotations

import json
import random

import pytest
import torch

from bench.together import tokens_together
from engine import EngineConfig, open_engine
from engine.config import CompilationConfig
from engine.kv_groups import KVLayout, sequence_blocks
from engine.models.attention import SequenceChunk, build_metadata
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import OUTSIDE_WINDOW, KVBlockManager
from engine.sched.request import Request
from engine.worker import worker
from engine.worker.cuda_graphs import CallThrough, CapturedDecode
from engine.worker.worker import Worker
from tests.helpers import greedy
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.test_reference_transformers import COMMON, FAMILIES, VOCAB

GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # five sliding layers to one global


def test_layers_are_grouped_by_window_in_groups_the_size_of_the_rarest_kind():
    gemma = KVLayout.of(GEMMA3_270M)
    assert gemma.group_size == 3 and gemma.group_windows == (512, 512, None, 512, 512, 512)
    assert gemma.layer_group[:6] == (0, 0, 0, 1, 1, 2) and gemma.layer_slot[:6] == (0, 1, 2, 0, 1, 0)
    # every group holds one layer of each slot: a block id names the same place in every cache pair
    assert sorted(zip(gemma.layer_group, gemma.layer_slot, strict=True)) == \
        [(g, j) for g in range(6) for j in range(3)]
    gpt_oss = KVLayout.of([128 if i % 2 == 0 else None for i in range(24)])
    assert (gpt_oss.group_size, gpt_oss.group_windows) == (12, (128, None))
    gemma_1b = KVLayout.of([None if (i + 1) % 6 == 0 else 512 for i in range(26)])  # 22 sliding, 4 global
    assert gemma_1b.group_size == 4 and gemma_1b.group_windows.count(512) == 6  # the last sliding group half full
    for windows in ([None] * 5, [4096] * 5):  # one kind (Llama, Mistral): one group, a cache pair per layer
        one = KVLayout.of(windows)
        assert one.group_windows == (windows[0],) and one.layer_slot == (0, 1, 2, 3, 4)
    # a pipeline stage holding layers 9..17 numbers the cache pairs its layers use from 0
    assert gemma.local_slots(range(9, 18)) == [gemma.layer_slot[i] for i in range(9, 18)]
    assert KVLayout.of([None] * 8).local_slots(range(4, 8)) == [0, 1, 2, 3]


def test_a_long_sequence_holds_its_full_groups_blocks_and_a_window_in_each_sliding_group():
    """Gemma 3 270M's layout at 4,096 tokens: 256 blocks of 3 layers in the full group, a window's
    33 in each of five sliding groups: 421 blocks of 3 layers against one table's 256 of 18."""
    layout = KVLayout.of(GEMMA3_270M)
    blocks = sequence_blocks(layout.group_windows, 4096, 16, step_tokens=0)
    assert blocks == 256 + 5 * 33
    assert blocks * layout.group_size < 0.3 * 256 * len(GEMMA3_270M)


def test_each_groups_metadata_reads_its_own_tables_and_shares_the_masks_built_for_its_window():
    chunks = [[SequenceChunk(9, 1, [0, 1, 2]), SequenceChunk(4, 6, [3, 4, 5])],  # a decode and a prompt chunk
              [SequenceChunk(9, 1, [6, 7, 8]), SequenceChunk(4, 6, [9, 10, 11])]]
    meta = build_metadata(chunks[0], 4, torch.device("cpu"), other_kv_groups=chunks[1:])
    other = meta.of_group(1)
    # position 9 in block 2 of [6, 7, 8]; positions 4..9 in blocks 1 and 2 of [9, 10, 11]
    assert other.slot_mapping.tolist() == [8 * 4 + 1, *(4 * (10 if p < 8 else 11) + p % 4 for p in range(4, 10))]
    for window in (None, 4):
        for mine, theirs in zip(meta.groups_for(window), other.groups_for(window), strict=True):
            assert theirs.mask is mine.mask and theirs.block_table is not None
            assert theirs.block_table.tolist() == [b + 6 for b in mine.block_table.tolist()]
    assert not torch.equal(meta.groups_for(None)[1].mask, meta.groups_for(4)[1].mask)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def decode_to(kv: KVBlockManager, req: Request, length: int) -> None:
    while req.num_tokens < length:
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_computed_blocks(req)


def test_a_sliding_group_releases_the_blocks_behind_its_window_and_the_full_group_keeps_its_own():
    """Groups (full, window 8), blocks of 4: at 40 tokens the full table holds 10 blocks and the
    sliding one the window's; released ids stay in its table and another request may take them."""
    kv = KVBlockManager(num_blocks=24, block_size=4, group_windows=(None, 8))
    req = request("a", list(range(8)))
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    decode_to(kv, req, 40)
    full, sliding = kv.block_tables("a")
    assert len(full) == len(sliding) == 10 and not set(full) & set(sliding)
    # the last allocation, for position 39, released what it no longer sees (before 32): blocks 8 and 9 remain
    assert kv.blocks_held("a") == kv.num_used_blocks == 10 + 2
    other = request("b", list(range(100, 120)))
    assert kv.allocate_slots(other, 20)  # 10 blocks: more than the 4 never used
    assert set(kv.block_ids("b", 0) + kv.block_ids("b", 1)) & set(sliding[:7])
    kv.free(req)
    kv.free(other)
    assert kv.num_free_blocks == 24


def test_a_prefix_hit_takes_a_sliding_groups_window_and_misses_once_its_blocks_are_reused():
    kv = KVBlockManager(num_blocks=40, block_size=4, group_windows=(None, 8))
    prompt = list(range(50, 86))  # 36 tokens: 8 blocks may hit (one token is always computed)
    a = request("a", prompt)
    assert kv.allocate_slots(a, 36)
    a.num_computed_tokens = 36
    kv.cache_computed_blocks(a)
    decode_to(kv, a, 60)  # its sliding blocks before 13 are released, still cached
    b = request("b", prompt)
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 8
    assert hit.block_ids(0) == kv.block_ids("a", 0)[:8]
    # the next token (position 32) sees 25..32: blocks 6 and 7; before them, placeholders
    assert hit.tables[1][:6] == [OUTSIDE_WINDOW] * 6 and hit.block_ids(1)[6:] == kv.block_ids("a", 1)[6:8]
    used = kv.num_used_blocks
    assert kv.allocate_slots(b, 36 - 32, hit)
    assert kv.num_used_blocks == used + 2 + 2  # the two released sliding blocks revived, a new one per group
    assert kv.block_tables("b")[1][6:8] == kv.block_ids("a", 1)[6:8]
    kv.free(b)
    filler = request("x", list(range(200, 200 + 4 * 20)))  # takes every free block, the released ones too
    assert kv.allocate_slots(filler, (kv.num_free_blocks // 2) * 4)
    assert kv.find_cached_prefix(request("c", prompt)).num_blocks == 0
    kv.free(a)
    kv.free(filler)
    assert kv.num_free_blocks == 40


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES["gemma3"]
    return save_hf_checkpoint(tmp_path_factory, "gemma3-hybrid", config_cls, model_cls, {**COMMON, **extra})


PROMPTS = [random.Random(7).choices(range(3, VOCAB), k=n) for n in (8, 14, 20, 30)]
LENGTH = 72  # tokens each sequence reaches: 18 blocks of 4


def hybrid_config(path, **options) -> EngineConfig:
    """One sliding and one global layer: a block holds one layer. Four sequences of 72 tokens need
    4 x 18 global blocks and about 4 x 4 sliding ones: 100 blocks of one layer, the memory of 50
    blocks of two layers, where one table would need 72 of those."""
    return EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=100, max_num_seqs=4,
                        executor="inproc", **options)


async def run_together(config: EngineConfig) -> tuple[list[list[int]], int]:
    """Every prompt's greedy tokens, run together, and the preemptions it took."""
    async with open_engine(config) as engine:
        tokens = await tokens_together(engine, PROMPTS, greedy(LENGTH - 30, ignore_eos=True))
        return tokens, engine.stats().num_preemptions


async def test_gemma3_in_less_cache_than_one_table_needs_gives_transformers_tokens_without_preempting(
        gemma3, monkeypatch):
    path, hf_model = gemma3
    expected = transformers_greedy(hf_model, PROMPTS, LENGTH - 30)
    assert await run_together(hybrid_config(path, enforce_eager=True)) == (expected, 0)
    # On captured decode graphs (the CUDA path, its capture called through on CPU): each group's
    # slots and tables in the graph's buffers.
    captured: list[CapturedDecode] = []
    real = Worker._captured_decode

    def spy(self, caches, num_blocks):
        captured.append(real(self, caches, num_blocks))
        return captured[-1]

    monkeypatch.setattr(Worker, "_captures_graphs", lambda self: True)
    monkeypatch.setattr(Worker, "_captured_decode", spy)
    monkeypatch.setattr(worker, "CudaGraphCapture", CallThrough)
    # The decoder compiled with the groups' buffers (prompts stay eager: tests/test_cuda_graphs.py
    # compiles those).
    compilation = CompilationConfig(cudagraph_capture_sizes=(1, 2, 4), compile_prompts=False)
    assert await run_together(hybrid_config(path, enforce_eager=False, compilation_config=compilation)) == \
        (expected, 0)
    assert captured and captured[0].steps_run >= 20 and captured[0].compiled


async def test_the_same_memory_preempts_when_every_layer_is_global(gemma3, tmp_path):
    """The comparison: the checkpoint with both layers global (one table, blocks of two layers)
    in the same memory runs the four sequences only by preempting."""
    path, _ = gemma3
    full = tmp_path / "all-global"
    full.mkdir()
    for item in path.iterdir():
        (full / item.name).symlink_to(item)
    raw = json.loads((path / "config.json").read_text())
    (full / "config.json").unlink()
    (full / "config.json").write_text(json.dumps({**raw, "layer_types": ["full_attention"] * 2}))
    config = EngineConfig(model=str(full), dtype="float32", block_size=4, num_kv_blocks=50, max_num_seqs=4,
                          enforce_eager=True, executor="inproc")
    _, preemptions = await run_together(config)
    assert preemptions > 0
