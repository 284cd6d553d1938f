"""`python -m bench.host_steps MODEL`: the engine's time per decode step, offline, in one process.

Runs N prompts together through the in-process engine (the executor in this process, so a
sampling profiler such as `py-spy record -- python -m bench.host_steps ...` sees the event loop
and the worker's threads together) and prints, per round, tok/s and the wall time per engine step.
On a GPU, where a 0.5B model's decode step is a fraction of a millisecond of device work, the time
per step is the host's: scheduling, the inputs, the launch, the outputs. The first round warms up
(graphs, allocator); the later ones are measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import trio

from bench.throughput import BenchSpec, make_prompts
from bench.together import tokens_together
from engine.api.open import open_engine
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.sampling_params import RequestOutputKind, SamplingParams


async def measure(model: str, device: str, dtype: str | None, spec: BenchSpec, rounds: int, eager: bool,
                  tokenizer: str | None = None, num_scheduler_steps: int = 1, stream: bool = False,
                  kv_cache_dtype: str = "auto", q8_0_activations: str = "float32",
                  async_scheduling: bool | None = None) -> list[str]:
    config = EngineConfig(model=model, tokenizer=tokenizer, device=device, dtype=dtype or "auto",
                          kv_cache_dtype=kv_cache_dtype, q8_0_activations=q8_0_activations,
                          max_num_seqs=spec.concurrency, num_scheduler_steps=num_scheduler_steps,
                          async_scheduling=async_scheduling,
                          executor="inproc", enforce_eager=eager,
                          kv_cache_memory_bytes=None if device.startswith("cuda") else 1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    lines = []
    async with open_engine(config) as engine:
        core = engine.core
        assert isinstance(core, EngineCore), "open_engine runs its core in this process"
        for index in range(rounds):
            prompts = make_prompts(replace(spec, seed=index), 1000)
            steps_before, start = core.num_steps, time.perf_counter()
            await tokens_together(engine, prompts, params)
            elapsed = time.perf_counter() - start
            steps = core.num_steps - steps_before
            lines.append(f"round {index}: {spec.num_prompts} x {spec.input_len} in / {spec.output_len} out: "
                         f"{spec.num_prompts * spec.output_len / elapsed:,.0f} tok/s, {steps} steps, "
                         f"{elapsed / steps * 1e3:.3f} ms a step")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: the engine's (auto)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    parser.add_argument("--q8-0-activations", default="float32", help="the engine's --q8-0-activations")
    parser.add_argument("--tokenizer", default=None, help="for a GGUF file: the checkpoint directory of its tokenizer")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode bursts of up to N (default 1)")
    parser.add_argument("--stream", action="store_true",
                        help="an output per step, as a streaming server publishes (default: only the final one)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's --async-scheduling (default: the engine's)")
    args = parser.parse_args()
    spec = BenchSpec(args.prompts, args.input_len, args.output_len, args.prompts)
    trio.run(measure, args.model, args.device, args.dtype, spec, args.rounds, args.enforce_eager, args.tokenizer,
             args.num_scheduler_steps, args.stream, args.kv_cache_dtype, args.q8_0_activations, args.async_scheduling)


if __name__ == "__main__":
    main()
