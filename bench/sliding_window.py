"""`trio-llm bench sliding-window`: the KV blocks one long sequence holds on a model whose every
layer attends within a window (Mistral), against the same model with full attention: the same
sizes, weights, dtype, prompt and engine settings, the window the only difference. The most blocks
the sequence held while it generated is read from the engine's own KV usage after each token, and
the decode rate is printed beside it (the window also bounds each decode's attention)."""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from engine import EngineConfig, open_engine
from engine.models.tiny import make_model
from engine.models.tiny_spec import TinyModelSpec
from engine.sampling_params import RequestOutputKind, SamplingParams


async def held_blocks(model: str, prompt: list[int], output_len: int, block_size: int,
                      num_blocks: int) -> tuple[int, float]:
    """(the most KV blocks the sequence held, decode tokens/s)."""
    config = EngineConfig(model=model, dtype="float32", block_size=block_size, num_kv_blocks=num_blocks,
                          enforce_eager=True, max_model_len=len(prompt) + output_len)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    most, started, tokens = 0, None, 0
    async with open_engine(config) as engine:
        async for _ in engine.generate(prompt, params, "long"):
            most = max(most, round(engine.stats().kv_cache_usage * num_blocks))
            tokens += 1
            started = started or time.perf_counter()
        seconds = time.perf_counter() - (started or time.perf_counter())
    return most, (tokens - 1) / seconds if seconds > 0 else 0.0


async def run(length: int, window: int, block_size: int, prompt_len: int) -> str:
    spec = TinyModelSpec(arch="mistral", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=4096,
                         max_positions=length, sliding_window=window)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {f"sliding window {window}": make_model(Path(tmp) / "sliding", spec),
                  "full attention": make_model(Path(tmp) / "full", replace(spec, sliding_window=None))}
        prompt = random.Random(0).choices(range(3, spec.vocab), k=prompt_len)
        num_blocks = -(-length // block_size) + 1
        for name, path in models.items():
            most, rate = await held_blocks(str(path), prompt, length - prompt_len, block_size, num_blocks)
            rows.append((name, most, rate))
    head = (f"one sequence of {length} tokens ({prompt_len} prompt, {length - prompt_len} generated), Mistral "
            f"shape layers=4 hidden=256, float32, eager, block_size={block_size}, the same weights both sides")
    lines = [head, f"{'model':<22}{'most KV blocks held':>20}{'decode tok/s':>14}"]
    lines += [f"{name:<22}{most:>20}{rate:>14.1f}" for name, most, rate in rows]
    lines.append(f"ratio (full / sliding): {rows[1][1] / max(rows[0][1], 1):.1f}x the blocks")
    return "\n".join(lines)
