"""The compiled decode step: the decoder compiled by `torch.compile` (inductor) once per batch-size
bucket, as vLLM captures CUDA graphs for fixed batch sizes.

A step whose every sequence decodes one token (the steady state of serving) is padded to the
smallest bucket that holds it and runs the bucket's compiled graph; anything else (prefill,
mixed steps, batches above the largest bucket) runs the eager model. Shapes inside a bucket
are fixed but for the block table's width, which is marked dynamic, so a growing context never
compiles again.

Padding rows write their keys and values into a scratch block kept for them past the end of
the KV cache (the worker allocates it), and attend only to it: they can neither read nor
clobber a real sequence's cache, so padding never leaks into outputs.

Compiled artefacts are cached on disk by inductor (FX graph and AOTAutograd caches), under
`cache_dir` (default `~/.cache/trio-llm/torch_compile`): a restart traces again (dynamo) but
does not recompile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.models.attention import DecodeMetadata
from engine.models.decoder import DecoderForCausalLM, KVCache

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "trio-llm" / "torch_compile"


def use_compile_cache(cache_dir: str | None) -> None:
    """Point inductor's on-disk caches at `cache_dir` (or ours), unless the user already has.

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks a graph up, so setting it before
    the first compilation is enough; it is process-wide, as the cache is."""
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_CACHE_DIR))


class DecodeGraphs:
    """The compiled decode graphs of one model over one KV cache.

    `scratch_block`: a block id no sequence is ever given (the worker allocates one past the
    scheduler's blocks); padding rows use it."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                 scratch_block: int, buckets: Sequence[int]) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"decode batch-size buckets must be positive, got {list(buckets)}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = tuple(sorted(set(buckets)))
        device = model.embed_tokens.weight.device
        self.device = device
        for experts in model.moe_layers:
            experts.exclude_from_compilation()
        # One compiled callable: dynamo keys its graphs on the batch size (static) and the block
        # table's width (dynamic), so each bucket compiles once.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets) + 8)
        self._compiled: Callable[..., torch.Tensor] = torch.compile(model, dynamic=False, fullgraph=False)
        self._warm = False
        self.steps_run = 0  # decode steps served by a compiled graph since start-up (tests, metrics)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket holding `batch_size` sequences; None above the largest."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def compile_all(self, progress: Callable[[str], None] = logger.info) -> float:
        """Compile (or load from the cache) every bucket's graph by running it once on scratch
        rows; returns the seconds it took. Called once, at start-up."""
        start = time.perf_counter()
        for i, bucket in enumerate(self.buckets, 1):
            bucket_start = time.perf_counter()
            for width in (2, 3):  # two widths: the second proves the width is dynamic (no recompile)
                hidden = torch.zeros(bucket, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
                positions = torch.zeros(bucket, dtype=torch.long, device=self.device)
                self.run(hidden, positions, [], [], [], padded_width=width)
            progress(f"compiled the decode graph {i}/{len(self.buckets)} (batch {bucket}) in "
                     f"{time.perf_counter() - bucket_start:.1f} s")
        self._warm = True
        return time.perf_counter() - start

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slots: Sequence[int],
            seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], padded_width: int = 2) -> torch.Tensor:
        """One decode step of `len(slots)` sequences: `hidden` [n, H] their input embeddings,
        `positions` [n], each one's new slot, length (with the new token) and block table.
        `hidden` and `positions` may carry more rows than sequences (all padding). Returns the
        final hidden states of the real rows. The caller checks `bucket_for` first."""
        count = len(slots)
        bucket = self.bucket_for(max(count, hidden.shape[0]))
        assert bucket is not None, "batch above the largest bucket: the caller runs eagerly"
        pad = bucket - hidden.shape[0]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        meta = self._metadata(bucket, slots, seq_lens, block_tables, padded_width)
        torch._dynamo.maybe_mark_dynamic(meta.block_table, 1)
        if self._warm:
            # Once every bucket is compiled, only the guards that tell the buckets apart are
            # checked (~0.2 ms a step saved); nothing else a guard could catch changes here.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = self._compiled(hidden, positions, self.kv_caches, meta)
        else:
            out = self._compiled(hidden, positions, self.kv_caches, meta)
        if count:
            self.steps_run += 1
            return out[:count]
        return out

    def _metadata(self, bucket: int, slots: Sequence[int], seq_lens: Sequence[int],
                  block_tables: Sequence[Sequence[int]], min_width: int) -> DecodeMetadata:
        # Width at least 2: dynamo specialises a dimension of size 1, which would compile again.
        width = max([min_width, *(len(t) for t in block_tables)])
        scratch, pad = self.scratch_block, bucket - len(slots)
        table = [list(t) + [scratch] * (width - len(t)) for t in block_tables] + [[scratch] * width] * pad
        scratch_slot = scratch * self.block_size
        return DecodeMetadata(
            torch.tensor([*slots, *[scratch_slot] * pad], dtype=torch.long, device=self.device),
            torch.tensor(table, dtype=torch.long, device=self.device),
            torch.tensor([*seq_lens, *[1] * pad], dtype=torch.long, device=self.device),
            self.block_size)
