"""`trio-llm bench lora`: output tok/s of concurrent streams spread over 1, 4 and 16 LoRA adapters,
against the same streams on the base model alone, in one engine per setting; the time to read
and check one adapter; and what loading one while streams run costs them (`add_lora`'s time, and
the longest gap between a stream's tokens while it ran against the median gap).

The adapters are random, written here in PEFT's format (every attention and MLP projection of
every layer targeted: the most work an adapter can ask for). The base model is served without
LoRA (what a user without adapters gets); each level alternates it with the adapters over
`repeats` rounds, an engine opened for each wave, and reports medians.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import anyio
import torch
from safetensors.torch import save_file

from engine.api.open import open_engine
from engine.config import EngineConfig, LoRAModule
from engine.lora.adapter import read_adapter
from engine.lora_request import LoRARequest
from engine.models.hf_config import parse_decoder_config, read_config_json
from engine.sampling_params import RequestOutputKind, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, out_dir: Path, rank: int, seed: int) -> Path:
    """A random rank-`rank` adapter of the model at `model_dir`, saved as PEFT saves one."""
    cfg = parse_decoder_config(read_config_json(model_dir))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


async def _wave(config: EngineConfig, loras: list[str | None], prompts: list[list[int]], output_len: int,
                warm_up: bool) -> float:
    """Output tok/s of one stream per prompt (`loras[i]`: its adapter, None for the base model), in
    an engine opened for it (its compiled graphs load from the cache)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async with open_engine(config) as engine:
        async def one(prompt: list[int], name: str | None) -> None:
            lora = None if name is None else LoRARequest(name)
            async for _ in engine.generate(prompt, params, lora_request=lora):
                pass

        async def wave() -> float:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for prompt, name in zip(prompts, loras, strict=True):
                    tg.start_soon(one, prompt, name)
            return len(prompts) * output_len / (time.perf_counter() - start)

        if warm_up:  # every adapter read and placed, every path run once
            await wave()
        return await wave()


def _tok_per_s(base: EngineConfig, with_lora: EngineConfig, loras: list[str | None], input_len: int,
               output_len: int, vocab: int, repeats: int) -> tuple[float, float, list[float]]:
    """(base tok/s, adapters tok/s, each round's ratio): the base model served without LoRA against
    the same streams spread over the adapters; medians of `repeats` rounds, alternating which goes
    first."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in loras]
    rates: dict[bool, list[float]] = {False: [], True: []}
    # One unmeasured wave with adapters first: a process that has run one serves the base model
    # measurably slower afterwards (freed memory kept in the heap; docs/benchmarks.md), so every
    # measured wave, base and adapters alike, runs in that state.
    anyio.run(_wave, with_lora, loras, prompts, output_len, True, backend="trio")
    for i in range(repeats):
        for adapted in ((False, True) if i % 2 == 0 else (True, False)):
            names: list[str | None] = loras if adapted else [None] * len(loras)
            config = with_lora if adapted else base
            rates[adapted].append(anyio.run(_wave, config, names, prompts, output_len, True, backend="trio"))
    ratios = [adapted / base for base, adapted in zip(rates[False], rates[True], strict=True)]
    return statistics.median(rates[False]), statistics.median(rates[True]), ratios


async def _load_while_serving(config: EngineConfig, adapter: Path, prompts: list[list[int]], output_len: int,
                              loads: int) -> tuple[float, float, float]:
    """(add_lora ms, median gap between a stream's tokens ms, longest gap overlapping a load ms),
    medians over `loads` waves of base-model streams, each with one adapter loaded halfway."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    load_ms: list[float] = []
    median_gap: list[float] = []
    worst_gap: list[float] = []
    async with open_engine(config) as engine:
        for wave in range(loads + 1):  # the first unmeasured: every path run once
            gaps: list[tuple[float, float]] = []
            halfway = anyio.Event()

            async def one(prompt: list[int], gaps: list[tuple[float, float]] = gaps,
                          halfway: anyio.Event = halfway) -> None:
                last, count = None, 0
                async for _ in engine.generate(prompt, params):
                    now, count = time.perf_counter(), count + 1
                    if last is not None:
                        gaps.append((last, now))
                    last = now
                    if count == output_len // 2:
                        halfway.set()

            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt)
                await halfway.wait()
                start = time.perf_counter()
                await engine.add_lora(LoRARequest(f"loaded{wave}", 0, str(adapter)))
                end = time.perf_counter()
            if wave:
                load_ms.append((end - start) * 1000)
                median_gap.append(statistics.median(b - a for a, b in gaps) * 1000)
                worst_gap.append(max(b - a for a, b in gaps if b >= start and a <= end) * 1000)
    return statistics.median(load_ms), statistics.median(median_gap), statistics.median(worst_gap)


def run(model_dir: str, adapter_counts: list[int], ranks: list[int], streams: int, input_len: int, output_len: int,
        repeats: int, scratch: Path) -> str:
    cfg = parse_decoder_config(read_config_json(model_dir))
    lines = [f"model={model_dir} float32 torch_threads={torch.get_num_threads()} (both sides) streams={streams} "
             f"input_len={input_len} output_len={output_len} "
             f"rounds={repeats} (the base model without LoRA and with adapters alternating; medians)",
             "rank | adapters | base tok/s | with adapters tok/s | ratio (median of rounds, spread) | "
             "read one adapter ms"]
    for rank in ranks:
        paths = [write_adapter(model_dir, scratch / f"r{rank}-{i}", rank, seed=i) for i in range(max(adapter_counts))]
        start = time.perf_counter()
        read_adapter("a0", paths[0], rank, torch.float32)
        read_ms = (time.perf_counter() - start) * 1000
        for count in adapter_counts:
            modules = tuple(LoRAModule(f"a{i}", str(p)) for i, p in enumerate(paths[:count]))
            base_config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=max(streams, 16))
            config = replace(base_config, enable_lora=True, lora_modules=modules, max_loras=count,
                             max_lora_rank=rank)
            loras: list[str | None] = [f"a{i % count}" for i in range(streams)]
            base, adapted, ratios = _tok_per_s(base_config, config, loras, input_len, output_len, cfg.vocab_size,
                                               repeats)
            lines.append(f"{rank:4d} | {count:8d} | {base:10.1f} | {adapted:19.1f} | {statistics.median(ratios):5.2f} "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) | {read_ms:.1f}")
    lines += ["", f"one adapter loaded while {streams} base-model streams run (--allow-runtime-lora-updating; "
                  f"medians of {repeats} loads)",
              "rank | add_lora ms | median token gap ms | longest gap during the load ms"]
    rng = random.Random(1)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(input_len)] for _ in range(streams)]
    for rank in ranks:
        config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=max(streams, 16), enable_lora=True,
                              max_lora_rank=rank, allow_runtime_lora_updating=True, max_cpu_loras=repeats + 1)
        loaded = anyio.run(_load_while_serving, config, scratch / f"r{rank}-0", prompts, output_len, repeats,
                           backend="trio")
        lines.append(f"{rank:4d} | {loaded[0]:11.1f} | {loaded[1]:19.1f} | {loaded[2]:.1f}")
    return "\n".join(lines)
