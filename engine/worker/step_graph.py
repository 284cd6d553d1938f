"""The compiled step graph: every step the decode graph does not take (prompt chunks, the prompt
part of a mixed step, decode batches above its largest size), compiled once for any token count.

Attention is the one part of a step whose shape depends on the batch's make-up (how many
sequences, how long, cached or fresh). The graph leaves it opaque: each layer calls
`step_attention` (engine/models/attention.py), which finds the step's `AttentionMetadata` and the
KV caches where `run` puts them and runs the eager `paged_attention`. Everything around it (the
norms, rotary embedding, SwiGLU and the packed linears) is one AOTInductor graph with a dynamic
token count, exported and saved as the decode graph is (engine/worker/precompiled_graph.py): a
warm start loads it in milliseconds. vLLM-CPU compiles its model the same way, attention split
out as a custom op. On CUDA (`jit`) the same graph comes from `torch.compile` at each start, as
the captured decode graphs' decoder does (engine/worker/cuda_graphs.py): AOTInductor packages
are built for CPU only here.

What it buys is the elementwise work the eager model does op by op: a 128-token prompt chunk of
the small Llama took 6.2 against 8.3 ms eager on one thread, 512 tokens 28.5 against 32.7 ms
(docs/benchmarks.md). Only dense models on one rank take it, as for the exported decode graph;
the rest stay eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models.attention import AttentionMetadata, SequenceChunk, attention_step, build_metadata
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.worker import precompiled_graph
from engine.worker.decode_graphs import note_refusal, prepare_inductor, refused_before

logger = logging.getLogger(__name__)

TRACE_TOKENS = 256  # traced (and so its loops sized) at a typical prompt chunk's length
MIN_TOKENS = 2  # export specialises a dimension of size 1: one token runs eagerly


class StepGraph:
    """The step graph of one model over one KV cache. `scratch_block`: a block no sequence is
    given, where the start-up check writes. `cache_dir`: where the graph is packaged (None:
    compiled at each start, not saved). `jit`: compiled by `torch.compile` at each start instead
    of packaged (CUDA, where prompt steps are not captured: their token count varies)."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                 scratch_block: int, cache_dir: Path | None = None, jit: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.cache_dir = None if jit else cache_dir
        self.jit = jit
        self._step: precompiled_graph.GraphedStep | None = None
        self.loaded_from_disk = False  # whether compile() found the graph saved (tests)
        self.steps_run = 0  # steps this graph served (tests, metrics)

    def compile(self, progress: Callable[[str], None] = logger.info) -> float:
        """Load the saved graph, or export, compile and save it; returns the seconds it took. A model
        that does not export keeps running eagerly (logged). Called once, at start-up."""
        start = time.perf_counter()
        with torch.inference_mode():
            self._step = self._load_or_compile(progress)
        if self._step is not None:
            how = "loaded" if self.loaded_from_disk else "compiled"
            progress(f"{how} the step graph (prompt chunks, any length) in {time.perf_counter() - start:.1f} s")
        return time.perf_counter() - start

    def saved_on_disk(self) -> bool:
        """Whether `compile` would load the graph rather than compile it (see DecodeGraphs')."""
        return self.cache_dir is not None and precompiled_graph.artefact_path(
            self.cache_dir, self.model, self.kv_caches, self.block_size, TRACE_TOKENS, "step").exists()

    def takes(self, num_tokens: int) -> bool:
        return self._step is not None and MIN_TOKENS <= num_tokens <= precompiled_graph.MAX_ROWS

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of the flat batch `hidden` [T, H] at `positions` [T], attending as
        `meta` says (its keys and values written to the caches). The caller checks `takes` first."""
        assert self._step is not None, "compile() first"
        with attention_step(meta, self.kv_caches):
            out = self._step(hidden, positions)
        self.steps_run += 1
        return out

    def _load_or_compile(self, progress: Callable[[str], None]) -> precompiled_graph.GraphedStep | None:
        if self.jit:
            return self._jit_compiled(progress)
        path, step = precompiled_graph.saved(self.cache_dir, self.model, self.kv_caches, self.block_size,
                                             TRACE_TOKENS, "step", self._agrees_with_eager)
        if step is not None:
            self.loaded_from_disk = True
            return step
        if refused_before(path, "step"):
            return None
        prepare_inductor()
        progress("compiling the step graph with AOTInductor (the first start of this model here only)")
        device = self.model.device
        hidden = torch.zeros(TRACE_TOKENS, self.model.config.hidden_size, dtype=self.model.dtype, device=device)
        positions = torch.zeros(TRACE_TOKENS, dtype=torch.long, device=device)
        try:
            step = precompiled_graph.compile_and_save_graphed(path, self.model, hidden, positions)
        except Exception as exc:  # noqa: BLE001 -- export refuses many things; eager takes them all
            logger.warning("the step graph does not export (%s: %s); prompt chunks run eagerly",
                           type(exc).__name__, exc)
            note_refusal(path, exc)
            return None
        if not self._agrees_with_eager(step):
            logger.warning("the step graph just compiled disagrees with the model; prompt chunks run eagerly")
            return None
        return step

    def _jit_compiled(self, progress: Callable[[str], None]) -> precompiled_graph.GraphedStep | None:
        """`torch.compile`'s graph, compiled by its first call (the agreement check's)."""
        progress("compiling the step graph with torch.compile")
        step = precompiled_graph.jit_graphed_step(self.model)
        agrees = precompiled_graph.compiled_and_agrees(lambda: self._agrees_with_eager(step, raise_errors=True),
                                                       "step graph", "prompt chunks run eagerly")
        return step if agrees else None

    def _agrees_with_eager(self, step: precompiled_graph.GraphedStep, raise_errors: bool = False) -> bool:
        """Whether `step` computes what the eager model does on a prompt that fills the scratch block."""
        device = self.model.device
        generator = torch.Generator().manual_seed(0)
        tokens = max(self.block_size, MIN_TOKENS)
        blocks = list(range(self.scratch_block, self.scratch_block + 1)) * -(-tokens // self.block_size)
        hidden = torch.randn(tokens, self.model.config.hidden_size, generator=generator)
        hidden = hidden.to(device, self.model.dtype)
        positions = torch.arange(tokens, device=device)
        meta = build_metadata([SequenceChunk(0, tokens, blocks)], self.block_size, device, self.model.dtype)
        want = self.model(hidden, positions, self.kv_caches, meta).float()
        try:
            with attention_step(meta, self.kv_caches):
                got = step(hidden, positions).float()
        except Exception:  # noqa: BLE001 -- a graph for other shapes may fail any way it likes
            if raise_errors:
                raise
            return False
        error = float((got - want).norm() / want.norm().clamp_min(1e-6))
        return error < precompiled_graph.agreement_tolerance(self.model)
