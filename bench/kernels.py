"""`trio-llm bench kernels`: the kernels chosen for one compute thread (docs/decisions.md, "One compute
thread gets kernels of its own"), each beside the one it replaces, on this machine's threads.

- the LM head at one row: oneDNN over the packed weight against MKL over [in, out] rows;
- a causal prompt: torch's causal SDPA against `attention.causal_prompt_attention`'s query blocks;
- greedy sampling: `max(dim)` against the sampler's chunked argmax.

Each figure is the median of alternating rounds. Before each product the machine's caches are
flushed by reading a 64 MB buffer, as a decode step's other weights would (the heads here are
about the size of the last-level cache).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models import attention
from engine.models.packed_linear import pack_weight, packed_linear
from engine.worker.sampler import argmax_rows


@dataclass
class Pair:
    what: str
    before_name: str
    before_ms: float
    after_name: str
    after_ms: float


def _times_ms(fn: Callable[[], object], flush: torch.Tensor | None, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _pair(what: str, before: tuple[str, Callable[[], object]], after: tuple[str, Callable[[], object]],
          flush: torch.Tensor | None, repeats: int, rounds: int = 3) -> Pair:
    """Median of `rounds` alternating rounds of `repeats` calls each."""
    before[1](), after[1]()  # warm
    got: dict[int, list[float]] = {0: [], 1: []}
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            got[i] += _times_ms((before, after)[i][1], flush, repeats)
    return Pair(what, before[0], statistics.median(got[0]), after[0], statistics.median(got[1]))


def head_pair(vocab: int, hidden: int, flush: torch.Tensor, repeats: int) -> Pair:
    weight = torch.randn(vocab, hidden)
    packed, rows = pack_weight(weight), weight.t().contiguous()
    assert packed is not None, "oneDNN packing is expected on torch's CPU build"
    x = torch.randn(1, hidden)
    torch.testing.assert_close(torch.mm(x, rows), packed_linear(x, packed, None), rtol=1e-4, atol=1e-3)
    return _pair(f"LM head [{vocab}, {hidden}], 1 row", ("packed (oneDNN)", lambda: packed_linear(x, packed, None)),
                 ("[in, out] rows (MKL)", lambda: torch.mm(x, rows)), flush, repeats)


def attention_pair(tokens: int, repeats: int, heads: int = 4, kv_heads: int = 2, dim: int = 64) -> Pair:
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    q_seq, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, enable_gqa=True)

    def blocks() -> torch.Tensor:
        return attention.causal_prompt_attention(q, k, v, dim ** -0.5)

    return _pair(f"prompt attention, {tokens} tokens ({heads} q / {kv_heads} kv heads of {dim})",
                 ("causal SDPA", causal), ("query blocks", blocks), None, repeats)


def argmax_pair(rows: int, vocab: int, repeats: int) -> Pair:
    logits = torch.randn(rows, vocab)
    assert torch.equal(argmax_rows(logits), logits.max(dim=-1).indices)
    return _pair(f"greedy argmax, {rows} x {vocab}", ("max(dim)", lambda: logits.max(dim=-1).indices),
                 ("chunked", lambda: argmax_rows(logits)), None, repeats)


def run(repeats: int = 20) -> list[Pair]:
    flush = torch.randn(64 * 1024 * 1024 // 4)
    return [*(head_pair(vocab, hidden, flush, repeats) for vocab, hidden in ((32000, 256), (151936, 896))),
            *(attention_pair(tokens, repeats) for tokens in (256, 512, 1024)),
            *(argmax_pair(rows, vocab, repeats) for rows, vocab in ((16, 32000), (64, 32000), (16, 151936)))]


def report(pairs: list[Pair]) -> str:
    lines = [f"torch threads {torch.get_num_threads()}; medians of 3 alternating rounds",
             "kernel | before | ms | after | ms | after / before"]
    for p in pairs:
        lines.append(f"{p.what} | {p.before_name} | {p.before_ms:.3f} | {p.after_name} | {p.after_ms:.3f} | "
                     f"{p.after_ms / p.before_ms:.2f}x")
    return "\n".join(lines)
