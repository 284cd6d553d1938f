"""`trio-llm bench forward`: one decode step of the model, eager against compiled, per batch size;
with `--prompt-len`, one fresh prompt too, eager against the step graph.

Both run the same model over the same KV cache in one process: the eager forward (gathered
blocks, SDPA: the path of --enforce-eager) and the compiled decode graph
(`engine.worker.decode_graphs`), or for a prompt the step graph (`engine.worker.step_graph`:
attention eager inside it). Each decoding sequence has `context` cached tokens. With
`--profile`, a torch.profiler table of a few steps of each is printed too: where a decode step's
time goes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.attention import SequenceChunk, build_metadata
from engine.worker.decode_graphs import DecodeGraphs, use_compile_cache
from engine.worker.model_runner import ModelRunner
from engine.worker.step_graph import StepGraph
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
    def __init__(self, model_dir: str, batches: list[int], context: int, prompt_lens: Sequence[int] = (),
                 tokenizer: str | None = None) -> None:
        self.block_size = 16
        self.blocks_per_seq = math.ceil((context + 1) / self.block_size)
        num_blocks = max([max(batches) * self.blocks_per_seq, *(math.ceil(n / self.block_size) for n in prompt_lens)])
        config = EngineConfig(model=model_dir, tokenizer=tokenizer, enforce_eager=True, num_kv_blocks=num_blocks,
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
        self.step_graph = StepGraph(self.model, runner.kv_caches, self.block_size, num_blocks, cache_dir) \
            if prompt_lens else None
        for k_cache, v_cache in runner.kv_caches:  # cached keys and values: any finite numbers do
            k_cache.normal_()
            v_cache.normal_()

    def compile(self) -> float:
        with torch.inference_mode():
            seconds = self.graphs.compile_all(progress=print)
        if self.step_graph is not None:
            seconds += self.step_graph.compile(progress=print)
        return seconds

    def prompt_steps(self, tokens: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
        """(eager, step graph) prefill of one fresh prompt of `tokens` tokens, each returning the
        greedy next token."""
        assert self.step_graph is not None, "prompt_lens given to the constructor"
        graph, model = self.step_graph, self.model
        ids = torch.arange(tokens) % model.config.vocab_size
        positions = torch.arange(tokens)
        blocks = list(range(math.ceil(tokens / self.block_size)))

        def prefill(run: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
            def step() -> torch.Tensor:
                meta = build_metadata([SequenceChunk(0, tokens, blocks)], self.block_size, self.runner.device,
                                      model.dtype)
                return model.compute_logits(run(model.embed(ids), positions, meta)[-1:]).argmax(-1)
            return step

        return (prefill(lambda h, p, meta: model(h, p, self.runner.kv_caches, meta)), prefill(graph.run))

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

    def time_steps(self, batch: int, repeats: int, rounds: int = 3, prompt: bool = False) -> StepTimes:
        """Best of `rounds` alternating rounds of `repeats` steps each (this machine drifts); with
        `prompt`, of a fresh prompt of `batch` tokens instead of a decode step of `batch` sequences."""
        best = [math.inf, math.inf]
        with torch.inference_mode():  # the inputs too: the graphs were compiled for inference tensors
            eager, compiled = self.prompt_steps(batch) if prompt else self.steps(batch)
            assert torch.equal(eager(), compiled()), "eager and compiled disagree on greedy tokens"
            for _ in range(rounds):
                for i, step in enumerate((eager, compiled)):
                    step()
                    start = time.perf_counter()
                    for _ in range(repeats):
                        step()
                    best[i] = min(best[i], (time.perf_counter() - start) / repeats * 1000)
        return StepTimes(batch, best[0], best[1])

    def time_after_idle(self, batch: int, repeats: int, idle_s: float) -> float:
        """Median ms of the compiled decode step when each step follows `idle_s` of sleep, as a
        served token's step follows the loop's and the HTTP server's work: what the caches still
        hold of the weights by then is what a served step finds."""
        times = []
        with torch.inference_mode():
            _, compiled = self.steps(batch)
            compiled()
            for _ in range(repeats):
                time.sleep(idle_s)
                start = time.perf_counter()
                compiled()
                times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)

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


def report_prompts(times: list[StepTimes]) -> str:
    lines = [f"one fresh prompt, torch threads {torch.get_num_threads()} (best of 3 rounds)",
             "prompt tokens | eager ms | step graph ms | step graph speed-up",
             "--- | --- | --- | ---"]
    lines += [f"{t.batch} | {t.eager_ms:.2f} | {t.compiled_ms:.2f} | {t.speedup:.2f}x" for t in times]
    return "\n".join(lines)


def report(times: list[StepTimes], context: int) -> str:
    lines = [f"decode step, {context} cached tokens per sequence, torch threads {torch.get_num_threads()} "
             "(best of 3 rounds)",
             "batch | eager ms | compiled ms | compiled speed-up | compiled tok/s",
             "--- | --- | --- | --- | ---"]
    for t in times:
        lines.append(f"{t.batch} | {t.eager_ms:.2f} | {t.compiled_ms:.2f} | {t.speedup:.2f}x | "
                     f"{t.batch / t.compiled_ms * 1000:.0f}")
    return "\n".join(lines)
