"""`trio-llm bench eplb`: decode with expert parallelism over 2 worker processes on a skewed
workload, four ways in one run:

- off: no load balancing;
- static: EPLB measuring load but never rebalancing (the placement "off" runs with; its load
  imbalance is the "before" figure);
- async: rebalancing every `--step-interval` steps, layer by layer while decoding goes on;
- sync: the same rebalances, each whole at one step boundary (`use_async: false`).

Figures per variant: decode throughput (output tokens / s over the run), step time p50 / p99 (the
gaps between a request's consecutive tokens, as the engine's observer reports them), rebalances,
expert slots moved, and per-rank load imbalance (max / mean, over the steps since the last
rebalance). The model is a tiny random Mixtral whose router favours the experts that start on
rank 0 (`make_skewed_model`), and the prompts draw from a narrow slice of the vocabulary: rank
0 gets most of the tokens until the experts are rebalanced.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from safetensors.torch import load_file, save_file

from bench.models import cached_model
from engine.api import EngineConfig, SamplingParams, make_model, open_engine
from engine.config import EplbConfig
from engine.core.stats import NullObserver
from engine.models.tiny import TinyModelSpec
from engine.sampling_params import RequestOutputKind

SPEC = TinyModelSpec(arch="mixtral", layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=2048,
                     max_positions=1024, experts=8, top_k=2)


class StepGaps(NullObserver):
    def __init__(self) -> None:
        self.gaps: list[float] = []

    def on_tokens(self, inter_token_latency: float, num_tokens: int) -> None:
        self.gaps.append(inter_token_latency)


@dataclass
class Result:
    name: str
    tok_s: float
    p50_ms: float
    p99_ms: float
    rebalances: int
    moved: int
    imbalance: float | None

    def row(self) -> str:
        imbalance = "-" if self.imbalance is None else f"{self.imbalance:.2f}"
        return (f"| {self.name} | {self.tok_s:.0f} | {self.p50_ms:.1f} | {self.p99_ms:.1f} | {self.rebalances} | "
                f"{self.moved} | {imbalance} |")


def skewed_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 140) for _ in range(length)] for _ in range(count)]


async def run_variant(name: str, model: str, eplb: EplbConfig | None, prompts: list[list[int]],
                      output_len: int) -> Result:
    config = EngineConfig(model=model, tensor_parallel_size=2, enable_expert_parallel=True,
                          enable_eplb=eplb is not None, eplb_config=eplb or EplbConfig(),
                          kv_cache_memory_bytes=256 << 20, max_num_seqs=len(prompts))
    gaps = StepGaps()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async with open_engine(config, observer=gaps) as engine:
        warm = [o async for o in engine.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert warm
        gaps.gaps.clear()
        produced = 0

        async def one(prompt: list[int]) -> None:
            nonlocal produced
            async for output in engine.generate(prompt, params):
                produced += len(output.outputs[0].token_ids)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        elapsed = time.perf_counter() - started
        stats = engine.stats().eplb
    ordered = sorted(gaps.gaps)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    imbalance = None if stats is None else max(1 / b if b else float("inf") for b in stats.balancedness)
    return Result(name, produced / elapsed, statistics.median(ordered) * 1e3, p99 * 1e3,
                  stats.rebalances if stats else 0, stats.experts_moved if stats else 0, imbalance)


async def run_all(model: str, concurrency: int, input_len: int, output_len: int, step_interval: int,
                  redundant: int) -> list[Result]:
    prompts = skewed_prompts(concurrency, input_len)
    common: dict[str, Any] = {"window_size": step_interval, "step_interval": step_interval,
                              "num_redundant_experts": redundant}
    variants = [("off", None),
                ("static (measured, never rebalanced)", EplbConfig(**{**common, "step_interval": 10**9})),
                ("async", EplbConfig(**common)),
                ("sync", EplbConfig(**common, use_async=False))]
    return [await run_variant(name, model, eplb, prompts, output_len) for name, eplb in variants]


def make_skewed_model(path: Path) -> None:
    """The tiny Mixtral with the router rows of experts 4-7 (rank 1's, before any rebalance)
    scaled down: their logits stay near 0 while experts 0-3 score large, so rank 0 gets most tokens."""
    make_model(path, SPEC)
    weights = load_file(str(path / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            tensor[SPEC.experts // 2:] *= 0.01
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def run(model: str | None, concurrency: int, input_len: int, output_len: int, step_interval: int,
        redundant: int) -> str:
    model_path = cached_model(model, "bench-mixtral-skewed", make_skewed_model)
    results = trio.run(run_all, model_path, concurrency, input_len, output_len, step_interval, redundant)
    lines = [f"model {model_path}; 2 worker processes, expert parallel; {concurrency} requests x {input_len} "
             f"prompt + {output_len} output tokens, skewed; rebalance every {step_interval} steps, "
             f"{redundant} redundant experts",
             "| variant | output tok/s | step p50 ms | step p99 ms | rebalances | slots moved | imbalance max/mean |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [r.row() for r in results]
    off, static, async_, sync = results
    assert static.imbalance is not None and async_.imbalance is not None
    excess = (async_.imbalance - 1) / (static.imbalance - 1) if static.imbalance > 1 else float("nan")
    lines.append(f"async p99 / off p99: {async_.p99_ms / off.p99_ms:.2f}x; sync p99 / off p99: "
                 f"{sync.p99_ms / off.p99_ms:.2f}x; imbalance static -> async: {static.imbalance:.2f} -> "
                 f"{async_.imbalance:.2f} (excess over even: {excess:.0%} of before)")
    return "\n".join(lines)
