"""Our C causal-attention kernel (engine/kernels): equal to torch's causal SDPA, declined where it
does not apply, built once per machine into the cache, and absent without a compiler."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import causal_attention as kernel
from engine.kernels import native
from engine.models import attention
from engine.models.attention import SequenceChunk, build_metadata, paged_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    seq = [t.transpose(0, 1).unsqueeze(0).float() for t in (q, k, v)]
    return F.scaled_dot_product_attention(*seq, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def fused_qkv(tokens: int, q_heads: int, kv_heads: int, dim: int, seed: int, spread: float = 1.0):
    """q, k, v as the decoder has them: views of one projection's rows (a token stride wider than
    the heads)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=generator) * spread
    q, k, v = rows.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    return q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


def test_the_kernel_is_built_here():
    """CI and every machine with inductor's compiler build it: the tests below test it, not a fallback."""
    assert kernel.available()


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 129, 300])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(4, 2, 16), (3, 1, 64), (2, 2, 128)])
@pytest.mark.parametrize("threads", [1, 3])
def test_equals_causal_sdpa(tokens, q_heads, kv_heads, dim, threads):
    """Every block shape: a short last block of rows, a last chunk of keys past the prompt's end,
    grouped and ungrouped query heads, head sizes of one to eight vectors; the heads on one thread,
    or split unevenly over three (or capped at one thread per head)."""
    q, k, v = fused_qkv(tokens, q_heads, kv_heads, dim, seed=tokens * dim + q_heads)
    got = kernel.causal_attention(q, k, v, dim ** -0.5, threads=threads)
    assert got is not None and got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, reference(q, k, v, dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_scores_far_apart_give_softmax_exactly_zero_and_one_weights():
    """Scores hundreds apart (each row's maximum dwarfs the rest): exp() is clamped, not NaN, and
    each query still reads the value of its best key."""
    q, k, v = fused_qkv(40, 2, 1, 16, seed=3, spread=30.0)
    got = kernel.causal_attention(q, k, v, 1.0)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, k, v, 1.0), rtol=1e-4, atol=1e-4)


def test_declines_what_it_does_not_take():
    q, k, v = fused_qkv(20, 4, 2, 16, seed=1)
    assert kernel.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25) is None, "float32 only"
    odd = fused_qkv(20, 4, 2, 12, seed=1)  # 12 is no multiple of a vector
    assert kernel.causal_attention(*odd, 12 ** -0.5) is None
    heads_apart = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]  # [T, H, D] over [H, T, D]
    assert kernel.causal_attention(*heads_apart, 0.25) is None


def test_float32_prompts_take_the_kernel_on_torchs_threads_once_long_enough(monkeypatch, threads):
    prompts = [fused_qkv(100, 4, 2, 16, seed=2), fused_qkv(300, 4, 2, 16, seed=3)]
    expected = [reference(q, k, v, 0.25) for q, k, v in prompts]
    calls, sdpa_calls = [], []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: calls.append(kw["threads"]) or real(*a, **kw))
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw))
    for count in (1, 2):
        threads(count)
        for (q, k, v), rows in zip(prompts, expected, strict=True):
            torch.testing.assert_close(attention.causal_prompt_attention(q, k, v, 0.25), rows, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1, 1, 2], "two threads for 300 tokens on two; one for 100 (not worth starting one)"
    assert sdpa_calls == [], "the kernel, not SDPA"


def test_built_once_into_the_cache_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ("-o" in cmd and builds.append(cmd)) or run(cmd, **kw))
    source = native.SOURCE_DIR / "causal_attention.c"
    compiler = native.shutil.which("cc")
    assert compiler is not None
    first = native._built(source, compiler)
    second = native._built(source, compiler)
    assert first == second and first.is_relative_to(tmp_path / "trio-llm" / "kernels")
    assert len(builds) == 1, "the second load found the library built"
    assert [p.name for p in first.parent.iterdir()] == [first.name], "no partial file left behind"


def test_a_build_keeps_the_most_recently_used_builds_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels = tmp_path / "trio-llm" / "kernels"
    kernels.mkdir(parents=True)
    older = [kernels / f"causal_attention-old{i}.so" for i in range(native.KEEP_BUILDS + 1)]
    for age, path in enumerate(older):
        path.write_bytes(b"")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))  # old0 the newest of them
    other = kernels / "another_kernel-x.so"
    other.write_bytes(b"")
    os.utime(other, (1, 1))
    built = native._built(native.SOURCE_DIR / "causal_attention.c", native.shutil.which("cc"))
    kept = sorted(p.name for p in kernels.iterdir())
    assert kept == sorted([built.name, *(p.name for p in older[:native.KEEP_BUILDS - 1]), other.name])


def test_without_a_compiler_torch_keeps_the_work(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load.__wrapped__("causal_attention") is None
    assert "no C compiler" in caplog.text


def test_a_failing_build_is_logged_and_declined(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-fno-such-flag"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load.__wrapped__("causal_attention") is None
    assert "could not build" in caplog.text and "no-such-flag" in caplog.text
    assert not any((tmp_path / "trio-llm" / "kernels").iterdir()), "no partial file left behind"


@pytest.mark.parametrize(("past", "queries"), [(5, 1), (16, 16), (37, 70), (200, 3)])
def test_a_chunk_after_cached_positions_reads_the_cache_through_its_slots(past, queries):
    """Keys and values of earlier positions in scattered cache blocks: the chunk's rows equal the
    whole sequence's causal attention at its positions."""
    heads, kv_heads, dim, block_size = 4, 2, 16, 16
    q, k, v = fused_qkv(past + queries, heads, kv_heads, dim, seed=past + queries)
    num_blocks = -(-(past + queries) // block_size)
    block_ids = torch.randperm(3 * num_blocks, generator=torch.Generator().manual_seed(past))[:num_blocks]
    slots = (block_ids[:, None] * block_size + torch.arange(block_size)).view(-1)[:past + queries].contiguous()
    k_cache, v_cache = (torch.full((3 * num_blocks * block_size, kv_heads, dim), float("nan")) for _ in range(2))
    k_cache[slots], v_cache[slots] = k, v  # NaN everywhere no position of this sequence lies
    got = kernel.causal_attention(q[past:], k_cache, v_cache, dim ** -0.5, past=past, kv_rows=slots)
    assert got is not None
    torch.testing.assert_close(got, reference(q, k, v, dim ** -0.5)[past:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("starts", [(0, 0, 0), (0, 24), (40,), (9, 0, 33)])
def test_prompt_chunk_groups_on_one_thread_run_the_kernel_per_sequence_and_equal_the_masked_path(
        starts, threads, monkeypatch):
    """Several fresh prompts, a chunk after cached positions, and the two mixed: per sequence on
    the kernel, the same rows as the one padded, masked SDPA call (which runs where the kernel is
    declined)."""
    heads, kv_heads, dim, block_size = 4, 2, 16, 16
    generator = torch.Generator().manual_seed(sum(starts))
    lengths = [int(n) for n in torch.randint(5, 40, (len(starts),), generator=generator)]
    chunks, rows_q, rows_k, rows_v = [], [], [], []
    k_cache, v_cache = (torch.zeros(64 * block_size, kv_heads, dim) for _ in range(2))
    next_block = 0
    for start, length in zip(starts, lengths, strict=True):
        q, k, v = fused_qkv(start + length, heads, kv_heads, dim, seed=start * 100 + length)
        blocks = list(range(next_block, next_block + -(-(start + length) // block_size)))
        next_block += len(blocks)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(start + length)])
        k_cache[slots], v_cache[slots] = k, v
        chunks.append(SequenceChunk(start, length, blocks))
        rows_q.append(q[start:]), rows_k.append(k[start:]), rows_v.append(v[start:])
    q, k, v = torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v)
    meta = build_metadata(chunks, block_size, torch.device("cpu"))
    assert [g.mask is not None for g in meta.groups] == [True], "one group of prompt chunks, masked"
    threads(1)
    ran = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: ran.append(kw.get("past", 0)) or real(*a, **kw))
    by_kernel = paged_attention(q, k, v, k_cache, v_cache, meta, dim ** -0.5)
    assert ran == list(starts), "one kernel call per sequence, cached ones through the cache"
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: None)
    masked = paged_attention(q, k, v, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(by_kernel, masked, rtol=1e-5, atol=1e-5)
