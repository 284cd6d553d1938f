"""Our decode attention kernel (engine/kernels/paged_decode.c): a step's decodes over the paged KV
cache, read in place from a float32 or 16-bit cache on torch's threads, equal to SDPA over each
sequence's positions; eagerly in a step's decode group, and as the compiled decode graph's
operator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import paged_decode as kernel
from engine.models import attention
from engine.models.attention import DecodeMetadata, SequenceChunk, build_metadata, paged_attention


def cached_decodes(batch: int, q_heads: int, kv_heads: int, dim: int, block_size: int, seed: int,
                   max_length: int = 70):
    """`batch` decodes over 1 to `max_length` - 1 cached positions each, in blocks spread over a
    cache (NaN in every slot no sequence holds: a read past a sequence's end would show):
    (q, caches, block table [B, nb], lengths, SDPA's output over each sequence's positions)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_length, (batch,), generator=generator)
    width = -(-int(lengths.max()) // block_size)
    table = torch.randperm(batch * width + 3, generator=generator)[:batch * width].view(batch, width)
    k_cache, v_cache = (torch.full(((batch * width + 3) * block_size, kv_heads, dim), float("nan")) for _ in range(2))
    q = torch.randn(batch, q_heads, dim, generator=generator)
    expected = []
    for b, length in enumerate(lengths.tolist()):
        k, v = (torch.randn(length, kv_heads, dim, generator=generator) for _ in range(2))
        slots = (table[b][:, None] * block_size + torch.arange(block_size)).view(-1)[:length]
        k_cache[slots], v_cache[slots] = k, v
        seq = [t.transpose(0, 1) for t in (q[b][None], k, v)]
        expected.append(F.scaled_dot_product_attention(*seq, scale=dim ** -0.5, enable_gqa=True).transpose(0, 1)[0])
    return q, k_cache, v_cache, table, lengths, torch.stack(expected)


def test_the_kernel_is_built_here():
    """CI and every machine with inductor's compiler build it: the tests below test it, not a fallback."""
    assert kernel.available()


@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(4, 2, 16), (7, 1, 64), (3, 3, 32), (16, 2, 64),
                                                          (8, 2, 128), (2, 1, 48)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decodes_equal_sdpa_over_each_sequences_cached_positions(q_heads, kv_heads, dim, threads):
    """One to four query heads per KV head and more (a second run of heads), one KV head and
    several (a sequence's heads in one work item, or split where there are fewer sequences than
    threads twice over), head sizes compiled for (64, 128) and read at run time; sequences of 1 to
    69 positions in blocks spread over the cache, some ending inside a chunk."""
    for batch in (9, 1):
        q, k_cache, v_cache, table, lengths, expected = cached_decodes(batch, q_heads, kv_heads, dim, 16,
                                                                       seed=q_heads + dim + batch)
        got = kernel.decode_attention(q, k_cache, v_cache, table, lengths, 16, dim ** -0.5, threads)
        assert got is not None and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_is_read_as_the_float32_cache_of_its_values(cache_dtype):
    """`--kv-cache-dtype`: the kernel widens each element as it reads it, so a 16-bit cache gives
    what a float32 cache holding the same (rounded) values gives."""
    q, k_cache, v_cache, table, lengths, _ = cached_decodes(6, 4, 2, 64, 16, seed=5, max_length=200)
    narrow = [c.to(cache_dtype) for c in (k_cache, v_cache)]
    got = kernel.decode_attention(q, *narrow, table, lengths, 16, 0.125, 2)
    wide = kernel.decode_attention(q, *(c.float() for c in narrow), table, lengths, 16, 0.125, 2)
    assert got is not None and wide is not None
    torch.testing.assert_close(got, wide, rtol=1e-6, atol=1e-6)
    exact = kernel.decode_attention(q, k_cache, v_cache, table, lengths, 16, 0.125, 2)
    assert not torch.equal(got, exact), "the values were rounded to the cache's dtype"


def test_scores_far_apart_keep_the_best_keys_value():
    """Scores hundreds apart across chunks (the running maximum grows chunk after chunk): the sums
    so far are rescaled, not overflowed, and each query reads the value of its best key."""
    q, k_cache, v_cache, table, lengths, _ = cached_decodes(3, 2, 1, 16, 16, seed=9, max_length=120)
    k_cache = k_cache * 30.0
    got = kernel.decode_attention(q, k_cache, v_cache, table, lengths, 16, 1.0, 1)
    assert got is not None and torch.isfinite(got).all()
    meta = DecodeMetadata(torch.zeros(3, dtype=torch.long), table, lengths, 16)
    filled = [torch.nan_to_num(c).double() for c in (k_cache, v_cache)]
    reference = attention.paged_decode_attention(q.double(), *filled, meta, 1.0)
    torch.testing.assert_close(got.double(), reference, rtol=1e-4, atol=1e-4)


def test_declines_what_it_does_not_take():
    q, k_cache, v_cache, table, lengths, _ = cached_decodes(2, 4, 2, 16, 16, seed=1)
    assert kernel.decode_attention(q, k_cache.double(), v_cache.double(), table, lengths, 16, 0.25, 1) is None
    odd = torch.zeros(k_cache.shape[0], 2, 12)  # 12 is no multiple of a vector
    assert kernel.decode_attention(torch.zeros(2, 4, 12), odd, odd, table, lengths, 16, 0.25, 1) is None
    assert kernel.decode_attention(torch.zeros(2, 3, 16), k_cache, v_cache, table, lengths, 16, 0.25, 1) is None


@pytest.mark.parametrize("count", [1, 2])
def test_a_decode_group_runs_the_kernel_on_torchs_threads_and_equals_the_masked_path(threads, count, monkeypatch):
    q, k_cache, v_cache, table, lengths, expected = cached_decodes(5, 4, 2, 16, 16, seed=11)
    chunks = [SequenceChunk(int(n) - 1, 1, table[b].tolist()) for b, n in enumerate(lengths)]
    meta = build_metadata(chunks, 16, torch.device("cpu"))
    last = [table[b][(n - 1) // 16] * 16 + (n - 1) % 16 for b, n in enumerate(lengths.tolist())]
    k_new, v_new = k_cache[torch.stack(last)], v_cache[torch.stack(last)]
    threads(count)
    ran = []
    real = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: ran.append((a[0].shape[0], a[-1])) or real(*a))
    by_kernel = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 16 ** -0.5)
    assert ran == [(5, count)], "one kernel call for the group, on torch's threads"
    torch.testing.assert_close(by_kernel, expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: None)
    k_cache, v_cache = (torch.nan_to_num(c) for c in (k_cache, v_cache))  # the masked path multiplies every slot
    torch.testing.assert_close(paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 16 ** -0.5), expected,
                               rtol=1e-5, atol=1e-5)


def test_the_decode_graphs_attention_is_the_kernels_operator_where_it_applies():
    """`DecodeMetadata.attend` (the compiled decode graph's attention) traces to one opaque
    `trio_llm::paged_decode` with the scale folded into the queries, and computes what the
    reductions written for inductor do; with a sliding window it keeps those reductions."""
    q, k_cache, v_cache, table, lengths, expected = cached_decodes(4, 4, 2, 64, 16, seed=3)
    k_cache, v_cache = (torch.nan_to_num(c) for c in (k_cache, v_cache))
    meta = DecodeMetadata(torch.zeros(4, dtype=torch.long), table, lengths, 16)

    class Attend(torch.nn.Module):
        def __init__(self, window: int | None) -> None:
            super().__init__()
            self.window = window

        def forward(self, q, k_cache, v_cache, table, lengths):
            return DecodeMetadata(torch.zeros(4, dtype=torch.long), table, lengths, 16).attend(
                q, k_cache, v_cache, 0.125, self.window)

    inputs = (q, k_cache, v_cache, table, lengths)
    for window, kernel_called in ((None, True), (8, False)):
        exported = torch.export.export(Attend(window), inputs)
        targets = {node.target for node in exported.graph.nodes if node.op == "call_function"}
        assert (torch.ops.trio_llm.paged_decode.default in targets) == kernel_called
    torch.testing.assert_close(meta.attend(q, k_cache, v_cache, 0.125), expected, rtol=1e-5, atol=1e-5)
    windowed = attention.paged_decode_attention(q, k_cache, v_cache, meta, 0.125, 8)
    torch.testing.assert_close(meta.attend(q, k_cache, v_cache, 0.125, 8), windowed)


def test_one_thread_calls_shared_with_the_lent_cpus_helper_give_the_same_outputs():
    """Served, the worker lends the HTTP server's CPU to a helper thread (engine/kernels/lent_cpu.h)
    and shares one-thread decode attention with it: the calling thread and the helper claim work
    items from one counter (a sequence's KV heads split where sequences are few). The outputs are
    the call's alone, bit for bit, whichever items the helper got to run; calls of fewer than 2,048
    cached rows (positions x KV heads) are not shared, the same either way."""
    import os

    from engine.kernels import q8_0_rows

    cases = [cached_decodes(batch, 4, 2, 64, 16, seed=batch, max_length=longest)
             for batch, longest in ((1, 300), (3, 3000), (16, 300))]
    # Shared: three sequences (each split per KV head) and sixteen; not: one of a few positions.
    assert [int(case[4].sum()) * 2 >= 2048 for case in cases] == [False, True, True]

    def outputs() -> list[torch.Tensor | None]:
        return [kernel.decode_attention(q, k, v, table, lengths, 16, 0.125, 1)
                for q, k, v, table, lengths, _ in cases]

    alone = outputs()
    for got, case in zip(alone, cases, strict=True):
        assert got is not None
        torch.testing.assert_close(got, case[-1], rtol=1e-5, atol=1e-5)
    assert q8_0_rows.lend_cpus(sorted(os.sched_getaffinity(0))[:1])
    share = q8_0_rows.lent_share_address()
    assert share is not None and kernel.share_with(share)
    for _ in range(20):  # the helper joins some calls and misses others: the same outputs either way
        assert all(torch.equal(a, b) for a, b in zip(alone, outputs(), strict=True))
