"""The compiled decode step: the decoder compiled by `torch.compile` (inductor) once, for every
batch size up to the largest capture size, as vLLM-CPU compiles its model with a dynamic batch.

A step's decodes (every step's, mixed steps included) run the compiled graph when there are at
most `max_batch` of them; prefill chunks and larger batches run the eager model. The graph's batch
size and block-table width are both dynamic, so neither a new batch size nor a growing context
compiles again. Dynamo specialises a dimension of size 1, so one row is padded to two (and the
table to two blocks) rather than compile a second graph: at batch 1 the forward is bound by
reading the weights, and a second row costs little.

(CUDA graphs need one capture per batch size, hence vLLM's `cudagraph_capture_sizes`; a graph per
size here took 9 s of a warm start for seven sizes, against 2.3 s for the one dynamic graph,
which steps as fast: docs/benchmarks.md.)

Padding rows write their keys and values into a scratch block kept for them past the end of
the KV cache (the worker allocates it), and attend only to it: they can neither read nor
clobber a real sequence's cache, so padding never leaks into outputs.

Compiled artefacts are cached on disk by inductor (FX graph and AOTAutograd caches), under
`cache_dir` (default `~/.cache/trio-llm/torch_compile`): a restart traces again (dynamo) but
does not recompile.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.models.attention import DecodeMetadata
from engine.models.decoder import DecoderForCausalLM, KVCache

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "trio-llm" / "torch_compile"


def use_compile_cache(cache_dir: str | None) -> None:
    """Point inductor's on-disk caches at `cache_dir` (or ours), unless the user already has, and
    settle which vector instructions its C++ uses (`settle_vector_isa`).

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks a graph up, so setting it before
    the first compilation is enough; it is process-wide, as the cache is."""
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_CACHE_DIR))
    settle_vector_isa(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]))


def settle_vector_isa(cache_dir: Path) -> None:
    """Spare every start after the first inductor's probe of the vector instruction sets.

    Before its first C++ kernel, inductor builds a test library for each instruction set the CPU
    reports and loads it in a child process: ~1.6 s of each start (half a warm start's compiling).
    The answer depends on the machine, its compiler and torch alone. So the first start probes
    and, when every reported set passed, records it beside the cache; it and every later start
    then tell inductor so (`cpp.vec_isa_ok`, TORCHINDUCTOR_VEC_ISA_OK), which also keeps inductor's
    settings, and so its cache keys, the same from the first start on. A set that fails its probe
    leaves inductor probing at each start, as it would. A user's TORCHINDUCTOR_VEC_ISA_OK wins."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    if inductor_config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    key = hashlib.sha256(repr((torch.__version__, sys.executable, flags)).encode()).hexdigest()[:16]
    memo = cache_dir / f"vec-isa-probe-{key}"
    if not memo.exists():
        passed = cpu_vec_isa.valid_vec_isa_list()  # the probe
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text("passed" if [str(i) for i in passed] == [str(i) for i in reported] else "failed")
    if memo.read_text() == "passed":
        inductor_config.cpp.vec_isa_ok = True


MIN_ROWS = 2  # dynamo specialises a dimension of size 1: one row is padded to two
TRACE_ROWS = 64  # the rows the graph is traced with (see compile_all)


class DecodeGraphs:
    """The compiled decode graph of one model over one KV cache.

    `scratch_block`: a block id no sequence is ever given (the worker allocates one past the
    scheduler's blocks); padding rows use it. `capture_sizes`: the largest is the largest batch
    the graph runs (the rest only warm it up at start-up)."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                 scratch_block: int, capture_sizes: Sequence[int]) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"decode batch sizes must be positive, got {list(capture_sizes)}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        device = model.embed_tokens.weight.device
        self.device = device
        for experts in model.moe_layers:
            experts.exclude_from_compilation()
        # MoE layers run eager between graphs. Dynamo makes the later graphs' batch dynamic only
        # when it sees a second size (a recompile at start-up), so their guards stay evaluated.
        self._guards_needed = bool(model.moe_layers)
        # Each model compiled in one process (tests open many) adds an entry to forward's cache.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        self._compiled: Callable[..., torch.Tensor] = torch.compile(model, dynamic=False, fullgraph=False)
        self._warm = False
        self.steps_run = 0  # decode steps served by a compiled graph since start-up (tests, metrics)

    @property
    def max_batch(self) -> int:
        return self.capture_sizes[-1]

    def compile_all(self, progress: Callable[[str], None] = logger.info) -> float:
        """Compile (or load from the cache) the graph by running it on scratch rows, then run
        it once at every capture size (no compilation: the batch is dynamic); returns the
        seconds it took. Called once, at start-up."""
        start = time.perf_counter()
        # Traced first at TRACE_ROWS rows whatever the sizes: inductor sizes its parallel loops by
        # the sizes it traces with, and its cache key does not include them. A graph traced at
        # two rows ran single-threaded kernels at every size (13.7 against 12.1 ms a step at
        # batch 64 on two threads, 5.4 against 3.6 at 16), and a cached one would be reused so.
        for i, rows in enumerate((TRACE_ROWS, *sorted({MIN_ROWS, *self.capture_sizes}, reverse=True))):
            for width in (8, 2):  # two widths: the second proves the width is dynamic (no recompile)
                hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
                positions = torch.zeros(rows, dtype=torch.long, device=self.device)
                self.run(hidden, positions, [], [], [], padded_width=width)
            if i == 0:
                progress(f"compiled the decode graph (batch sizes 1-{self.max_batch}) in "
                         f"{time.perf_counter() - start:.1f} s")
        self._warm = True
        return time.perf_counter() - start

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slots: Sequence[int],
            seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], padded_width: int = 2) -> torch.Tensor:
        """One decode step of `len(slots)` sequences: `hidden` [n, H] their input embeddings,
        `positions` [n], each one's new slot, length (with the new token) and block table.
        `hidden` and `positions` may carry more rows than sequences (all padding). Returns the
        final hidden states of the real rows. The caller checks `max_batch` first."""
        count = len(slots)
        rows = max(hidden.shape[0], count, MIN_ROWS)
        assert count <= self.max_batch, "batch above the largest size: the caller runs eagerly"
        pad = rows - hidden.shape[0]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        meta = self._metadata(rows, slots, seq_lens, block_tables, padded_width)
        for batched in (hidden, positions, meta.slot_mapping, meta.block_table, meta.seq_lens):
            torch._dynamo.maybe_mark_dynamic(batched, 0)
        torch._dynamo.maybe_mark_dynamic(meta.block_table, 1)
        if self._warm and not self._guards_needed:
            # Once the graph is compiled no guard can fail that matters here (batch and width are
            # dynamic, and never 1): skipping their evaluation saves ~0.2 ms a step.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = self._compiled(hidden, positions, self.kv_caches, meta)
        else:
            out = self._compiled(hidden, positions, self.kv_caches, meta)
        if count:
            self.steps_run += 1
            return out[:count]
        return out

    def _metadata(self, rows: int, slots: Sequence[int], seq_lens: Sequence[int],
                  block_tables: Sequence[Sequence[int]], min_width: int) -> DecodeMetadata:
        # Width at least 2: dynamo specialises a dimension of size 1, which would compile again.
        width = max([min_width, *(len(t) for t in block_tables)])
        scratch, pad = self.scratch_block, rows - len(slots)
        table = [list(t) + [scratch] * (width - len(t)) for t in block_tables] + [[scratch] * width] * pad
        scratch_slot = scratch * self.block_size
        return DecodeMetadata(
            torch.tensor([*slots, *[scratch_slot] * pad], dtype=torch.long, device=self.device),
            torch.tensor(table, dtype=torch.long, device=self.device),
            torch.tensor([*seq_lens, *[1] * pad], dtype=torch.long, device=self.device),
            self.block_size)
