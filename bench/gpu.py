"""`trio-llm bench gpu`: the one device check, sized to a 15-minute GPU lease with a rerun.

In order, each part printed as soon as it is measured (a lease that runs out keeps what came
before), on the default path (`serve` as a user runs it: compiled, i.e. CUDA graphs on CUDA):

1. parity: a tiny Llama made here, greedy tokens of 8 prompts x 24 against transformers' `generate`
   on the same device: float32 must be equal; bfloat16, the mean common prefix is printed;
2. the card's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus written), the floor
   every figure below is set against;
3. offline: the Qwen2.5-0.5B shape, N prompts of 128 tokens in and 128 out through the engine,
   against transformers' batched `generate` (batch 64) on the same prompts;
4. the device's idle time between steps: one sequence decoding under torch.profiler, the gaps
   between consecutive kernels (`step_gaps`; issue 48 asks for under 0.5 ms between two steps);
5. served: `trio-llm serve` on that model, streaming, 1 / 16 / 64 / 256 streams: tok/s, TTFT, ITL,
   and each level's floor (the weights and the KV cache read once per step, over the bandwidth);
6. the same served levels (1 and 64 streams) on a Llama-3-8B shape, random weights.

`--quick` (with `--device cpu`) runs every part at tiny sizes: the check of this script itself,
which costs no device time.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import trio

from bench.serve import LevelResult, _percentile, run_level
from bench.side_by_side import SERVED_NAME, requests_for, served, warm_up
from bench.throughput import BenchSpec, make_prompts, transformers_tokens_per_s
from bench.together import tokens_together
from engine.api.open import open_engine
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models.tiny import TinyModelSpec, make_model, shaped_spec
from engine.sampling_params import RequestOutputKind, SamplingParams

PARITY_SPEC = TinyModelSpec(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024)
PARITY_PROMPTS, PARITY_TOKENS = 8, 24


@dataclass(frozen=True)
class Plan:
    device: str
    shapes: tuple[TinyModelSpec, ...]  # the served models: the 0.5B shape, then the 8B
    offline: BenchSpec
    levels: tuple[tuple[int, ...], ...]  # served stream counts, per shape
    requests: int  # requests per served level (at least one per stream)


def plan(device: str, quick: bool) -> Plan:
    if quick:
        tiny = replace(PARITY_SPEC, dtype="bfloat16")
        return Plan(device, (tiny, tiny), BenchSpec(16, 16, 16, 16), ((1, 4), (1,)), 8)
    return Plan(device, (shaped_spec("qwen2.5-0.5b", dtype="bfloat16"), shaped_spec("llama3-8b", dtype="bfloat16")),
                BenchSpec(256, 128, 128, 256), ((1, 16, 64, 256), (1, 64)), 256)


def say(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def timing(label: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    say(f"[{label}: {time.perf_counter() - start:.1f} s]")


# ---- 1. parity ---------------------------------------------------------------------------------
def _ours(model: str, device: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def main() -> list[list[int]]:
        config = EngineConfig(model=model, device=device, dtype=dtype, enforce_eager=False,
                              kv_cache_memory_bytes=256 << 20, executor="inproc")
        async with open_engine(config) as engine:
            return await tokens_together(engine, prompts, params)
    return trio.run(main)


def _theirs(model: str, device: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    hf = hf.to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PARITY_TOKENS,
                                 min_new_tokens=PARITY_TOKENS, do_sample=False, pad_token_id=0)
            out.append(tokens[0, len(prompt):].tolist())
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def parity(device: str, scratch: Path) -> bool:
    model = str(make_model(scratch / "parity", PARITY_SPEC))
    prompts = make_prompts(BenchSpec(PARITY_PROMPTS, 12, PARITY_TOKENS, PARITY_PROMPTS), PARITY_SPEC.vocab)
    equal = True
    for dtype in ("float32", "bfloat16"):
        ours, theirs = _ours(model, device, dtype, prompts), _theirs(model, device, dtype, prompts)
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        prefix = statistics.mean(common_prefix(a, b) for a, b in zip(ours, theirs, strict=True))
        say(f"parity {dtype:<9} {same}/{len(prompts)} prompts equal to transformers on {device}; "
            f"mean common prefix {prefix:.1f} of {PARITY_TOKENS}")
        equal = equal and (same == len(prompts) or dtype != "float32")
    return equal


# ---- 2. the floor ------------------------------------------------------------------------------
def bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read plus written), best of 3 x 10 copies."""
    if not device.startswith("cuda"):
        from bench.roofline import read_bandwidth
        return read_bandwidth()
    source = torch.randn(1 << 28, device=device)  # 1 GiB, random (never time zeros)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(3):
        target.copy_(source)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(10):
            target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * source.nbytes / best


@dataclass(frozen=True)
class Floor:
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth: float

    def step_seconds(self, streams: int, context: int) -> float:
        return (self.weight_bytes + streams * context * self.kv_bytes_per_token) / self.bandwidth


def floor_of(spec: TinyModelSpec, bw: float) -> Floor:
    head_dim = spec.hidden // spec.heads
    width = 2 if spec.dtype in ("bfloat16", "float16") else 4
    attention = spec.hidden * head_dim * (spec.heads + 2 * spec.kv_heads) + spec.heads * head_dim * spec.hidden
    per_layer = attention + 3 * spec.hidden * spec.intermediate
    weights = (spec.layers * per_layer + 2 * spec.vocab * spec.hidden) * width
    return Floor(weights, 2 * spec.layers * spec.kv_heads * head_dim * width, bw)


def release_device_memory(device: str) -> None:
    """Hand an engine's memory (its KV cache, its model) back to the card once it is closed: the
    server started next measures what this process still holds as taken outside torch, and finds
    no room for its cache (the H200 run of 2026-11-27 failed so after the step gaps)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---- 3. offline --------------------------------------------------------------------------------
async def _engine_tokens_per_s(model: str, device: str, spec: BenchSpec) -> float:
    kv_bytes = None if device.startswith("cuda") else 1 << 30  # CUDA: what --gpu-memory-utilization leaves
    config = EngineConfig(model=model, device=device, dtype="bfloat16", max_num_seqs=spec.concurrency,
                          executor="inproc", kv_cache_memory_bytes=kv_bytes)
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async with open_engine(config) as engine:
        for prompts in (make_prompts(replace(spec, num_prompts=4, seed=1), 1000), make_prompts(spec, 1000)):
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(_drain, engine, prompt, params)
            elapsed = time.perf_counter() - start
    return spec.num_prompts * spec.output_len / elapsed


async def _drain(engine: Any, prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(prompt, params):
        pass


def offline(model: str, device: str, spec: BenchSpec) -> None:
    ours = trio.run(_engine_tokens_per_s, model, device, spec)
    from transformers import AutoModelForCausalLM
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    prompts = make_prompts(spec, 1000)
    batch = replace(spec, concurrency=min(64, spec.concurrency))
    transformers_tokens_per_s(hf, prompts[:batch.concurrency], batch)  # warm-up
    theirs = transformers_tokens_per_s(hf, prompts, batch)
    del hf
    release_device_memory(device)
    say(f"offline {spec.num_prompts} prompts x {spec.input_len} in / {spec.output_len} out, bfloat16, {device}: "
        f"trio-llm {ours:,.0f} tok/s, transformers generate (batch {batch.concurrency}) {theirs:,.0f} tok/s, "
        f"ratio {ours / theirs:.2f}x")


# ---- 4. the device's idle time between steps ----------------------------------------------------
def step_gaps(kernels: list[tuple[float, float]], steps: int) -> list[float]:
    """The device's idle time at step boundaries, longest first: the `steps - 1` longest gaps
    between consecutive kernels (`kernels`: (start, end) times, overlapping ones merged). Each
    boundary between two steps is one gap; a step's own kernels (a graph replay, the sampler) run
    back to back, so the longest gaps are the boundaries', or longer ones inside a step: either way
    no boundary's gap exceeds the largest reported."""
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(merged)]
    return sorted(gaps, reverse=True)[:max(steps - 1, 0)]


async def _profiled_decode(model: str, device: str, tokens: int,
                           vocab: int = 1000) -> tuple[list[tuple[float, float]], int]:
    """The device kernels ((start, end) in seconds) of one sequence decoding `tokens` tokens after a
    warm-up one, on the default path, and the engine steps they span."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    # One decode a step (no CPU burst): the gaps are between one token's kernels and the next's.
    config = EngineConfig(model=model, device=device, dtype="bfloat16", max_num_seqs=1, executor="inproc",
                          num_scheduler_steps=1)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = make_prompts(BenchSpec(1, 128, tokens, 1), vocab)[0]
    async with open_engine(config) as engine:
        core = engine.core
        assert isinstance(core, EngineCore), "open_engine runs its core in this process"
        await _drain(engine, prompt, params)  # warm-up
        steps_before = core.num_steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            await _drain(engine, prompt, params)
        steps = core.num_steps - steps_before
    kernels = [(event.time_range.start / 1e6, event.time_range.end / 1e6) for event in trace.events()
               if event.device_type == DeviceType.CUDA]
    return kernels, steps


def kernel_gaps(model: str, device: str, tokens: int) -> None:
    if not device.startswith("cuda"):
        say("step gaps: no device kernels to time on the CPU")
        return
    kernels, steps = trio.run(_profiled_decode, model, device, tokens)
    release_device_memory(device)
    gaps = step_gaps(kernels, steps)
    if not gaps:
        say(f"step gaps: {len(kernels)} kernels over {steps} steps, no gap to report")
        return
    say(f"step gaps over {steps} steps ({len(kernels)} kernels; the {len(gaps)} longest idle gaps, each at least "
        f"its boundary's): median {statistics.median(gaps) * 1e3:.3f} ms, largest {gaps[0] * 1e3:.3f} ms "
        f"(issue 48: under 0.5 ms)")


# ---- 5 and 6. served ---------------------------------------------------------------------------
# `--eager-baseline`: the same server with nothing compiled, its graphs capturing the eager model
EAGER_BASELINE = ("--compilation-config", '{"mode": 0}')


async def _served(model: str, device: str, levels: tuple[int, ...], requests: int, floor: Floor,
                  port: int, log: Path, extra: tuple[str, ...] = ()) -> None:
    command = [sys.executable, "-m", "web.cli", "serve", model, "--device", device, "--dtype", "bfloat16",
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
               "--max-num-seqs", str(max(levels)), *extra]
    if not device.startswith("cuda"):
        command += ["--kv-cache-memory-bytes", str(1 << 30)]
    input_len, output_len = 128, 128
    async with served("trio-llm", command, port, str(log)) as (url, startup):
        say(f"served {Path(model).name} on {device}{' ' + ' '.join(extra) if extra else ''}: start-up to healthy "
            f"{startup:.1f} s")
        await warm_up(url, input_len, 1000)
        say("  streams   tok/s   TTFT p50   ITL p50   ITL p99 |  floor ITL  floor tok/s  ITL/floor")
        for streams in levels:
            result = await run_level(url, SERVED_NAME, streams, requests_for(streams, requests), input_len,
                                     output_len, 1000, 300.0, None)
            say(_served_line(result, floor, input_len + output_len // 2))


def _served_line(result: LevelResult, floor: Floor, context: int) -> str:
    step = floor.step_seconds(result.concurrency, context)
    itl = _percentile(result.itl, .5)
    return (f"  {result.concurrency:>7} {result.output_tokens / result.elapsed:>7,.0f} "
            f"{_percentile(result.ttft, .5) * 1e3:>8.1f} ms {itl * 1e3:>6.2f} ms "
            f"{_percentile(result.itl, .99) * 1e3:>6.2f} ms | {step * 1e3:>6.2f} ms "
            f"{result.concurrency / step:>11,.0f}  {itl / step:>8.2f}x")


def run(device: str, quick: bool, port: int, logs: Path, eager_baseline: bool = False) -> int:
    """The whole check; the servers' logs go to `logs`. 0 when float32 parity holds.
    `eager_baseline`: the 0.5B shape is served a second time with nothing compiled (mode 0), on
    the same machine, so the compiled path's figures have their baseline beside them."""
    chosen = plan(device, quick)
    logs.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    say(f"trio-llm bench gpu: {device} ({card}), torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="trio-llm-gpu-") as scratch_dir:
        scratch = Path(scratch_dir)
        with timing("parity"):
            ok = parity(device, scratch)
        with timing("bandwidth"):
            bw = bandwidth(device)
        say(f"copy bandwidth {bw / 1e9:,.0f} GB/s (read + written)")
        for i, (spec, levels) in enumerate(zip(chosen.shapes, chosen.levels, strict=True)):
            with timing(f"make model {i}"):
                model = str(make_model(scratch / f"served-{i}", spec))
            if i == 0:
                with timing("offline"):
                    offline(model, device, chosen.offline)
                with timing("step gaps"):
                    kernel_gaps(model, device, 16 if quick else 64)
            with timing(f"served {i}"):
                trio.run(_served, model, device, levels, chosen.requests, floor_of(spec, bw), port,
                         logs / f"serve-{i}.log")
            if i == 0 and eager_baseline:
                with timing("served 0, eager baseline"):
                    trio.run(_served, model, device, levels, chosen.requests, floor_of(spec, bw), port,
                             logs / "serve-0-eager.log", EAGER_BASELINE)
    say("parity: float32 tokens equal" if ok else "parity FAILED: float32 tokens differ from transformers'")
    return 0 if ok else 1
