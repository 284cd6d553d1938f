"""`trio-llm bench forward`: one decode step of the model, eager against compiled, per batch size.

Both run the same model over the same KV cache in one process: the eager forward (gathered
blocks, SDPA: the path of prefill and of --enforce-eager) and the compiled decode graph
(`engine.worker.decode_graphs`). Each sequence has `context` cached tokens. With `--profile`, a
torch.profiler table of a few steps of each is printed too: where a decode step's time goes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.attention import SequenceChunk, build_metadata
from engine.worker.decode_graphs import DecodeGraphs, use_compile_cache
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker


@dataclass
class StepTimes:
    batch: int
    eager_ms: float
    compiled_ms: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.compiled_ms


class DecodeBench:
    def __init__(self, model_dir: str, batches: list[int], context: int) -> None:
        self.block_size = 16
        self.blocks_per_seq = math.ceil((context + 1) / self.block_size)
        num_blocks = max(batches) * self.blocks_per_seq
        config = EngineConfig(model=model_dir, enforce_eager=True, num_kv_blocks=num_blocks,
                              block_size=self.block_size, max_num_seqs=max(batches))
        self.worker = Worker(config)
        self.worker.load_model()
        self.worker.initialize_kv_cache(num_blocks + 1)  # the last block: the graphs' scratch block
        runner = self.worker.runner
        assert isinstance(runner, ModelRunner), "a decoder model"
        self.runner = runner
        self.model = runner.model
        self.context = context
        cache_dir = use_compile_cache(None)
        self.graphs = DecodeGraphs(self.model, runner.kv_caches, self.block_size, num_blocks, batches, cache_dir)
        for k_cache, v_cache in runner.kv_caches:  # cached keys and values: any finite numbers do
            k_cache.normal_()
            v_cache.normal_()

    def compile(self) -> float:
        with torch.inference_mode():
            return self.graphs.compile_all(progress=print)

    def steps(self, batch: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
        """(eager step, compiled step) for `batch` sequences, each returning greedy next tokens."""
        tables = [list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)) for i in range(batch)]
        ids = torch.arange(batch) % self.model.config.vocab_size
        pos = self.context
        positions = torch.full((batch,), pos)
        model, size = self.model, self.block_size

        def eager() -> torch.Tensor:
            meta = build_metadata([SequenceChunk(pos, 1, t) for t in tables], size, self.runner.device, model.dtype)
            return model.compute_logits(model(model.embed(ids), positions, self.runner.kv_caches, meta)).argmax(-1)

        def compiled() -> torch.Tensor:
            slots = [t[pos // size] * size + pos % size for t in tables]
            hidden = self.graphs.run(model.embed(ids), positions, slots, [pos + 1] * batch,
                                     [t[:pos // size + 1] for t in tables])
            return model.compute_logits(hidden).argmax(-1)

        return eager, compiled

    def time_steps(self, batch: int, repeats: int, rounds: int = 3) -> StepTimes:
        """Best of `rounds` alternating rounds of `repeats` steps each (this machine drifts)."""
        best = [math.inf, math.inf]
        with torch.inference_mode():  # the inputs too: the graphs were compiled for inference tensors
            eager, compiled = self.steps(batch)
            assert torch.equal(eager(), compiled()), "eager and compiled disagree on greedy tokens"
            for _ in range(rounds):
                for i, step in enumerate((eager, compiled)):
                    step()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        step()
                    best[i] = min(best[i], (time.perf_counter() - start) / repeats * 1000)
        return StepTimes(batch, best[0], best[1])

    def profile(self, batch: int, steps: int = 10) -> str:
        from torch.profiler import ProfilerActivity, profile
        tables = []
        with torch.inference_mode():
            for name, step in zip(("eager", "compiled"), self.steps(batch), strict=True):
                step()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(steps):
                        step()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
                tables.append(f"{name} decode, batch {batch}, {steps} steps:\n{table}")
        return "\n".join(tables)


def report(times: list[StepTimes], context: int) -> str:
    lines = [f"decode step, {context} cached tokens per sequence, torch threads {torch.get_num_threads()} "
             "(best of 3 rounds)",
             "batch | eager ms | compiled ms | compiled speed-up | compiled tok/s",
             "--- | --- | --- | --- | ---"]
    for t in times:
        lines.append(f"{t.batch} | {t.eager_ms:.2f} | {t.compiled_ms:.2f} | {t.speedup:.2f}x | "
                     f"{t.batch / t.compiled_ms * 1000:.0f}")
    return "\n".join(lines)
