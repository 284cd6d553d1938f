"""Decode steps as captured CUDA graphs: one per (batch size, block-table width), replayed over
static input buffers, as vLLM captures its decode step per `cudagraph_capture_sizes`.

A GPU step run eagerly is launch-bound: the 0.5B shape's decode launched ~976 kernels a step
from Python (issue 48). A captured graph replays them all in one call. What a replay needs:

- fixed shapes. A batch is padded up to the next captured size (`padded_size`), its block
  tables to the next captured width; the padding rows write their keys and values into the
  scratch block past the scheduler's blocks and attend only to it, as on the compiled CPU graph
  (engine/worker/decode_graphs.py), so padding never reaches a real sequence;
- fixed addresses. Each graph reads its inputs from buffers allocated once (the largest size
  and width; smaller graphs read a prefix), and a step copies its inputs into them;
- attention with shapes that do not depend on the lengths: `gathered_decode_attention` (SDPA
  over the gathered table, masked to each length), which runs on any device.

Which widths: a width bucket costs a graph per size, and a graph's gathered keys grow with
size x width, so wide tables get graphs only at the sizes where size x width tokens stays
within `GATHER_TOKEN_BUDGET`; a step no graph takes runs eagerly.

What a graph holds: by default the decoder compiled by `torch.compile` (inductor: each layer's
norms, rotary embedding, residual adds and activation fused into a few Triton kernels, the matrix
products left to cuBLAS), compiled once with a dynamic batch and table width, then captured at
each size, as vLLM compiles, then captures. Captured eagerly, the 0.5B shape's graph replayed
~1,280 kernels a step, and at a few microseconds each the device spent ~2.7 ms a step on what
reads its weights in 0.3 ms (the first H200 lease, docs/benchmarks.md). Compiled, a size of one
row runs on the graph of two (dynamo specialises a dimension of size one: a graph of its own
would compile once more; an extra row costs the device nothing measurable). `compile_model=False`
(`--compilation-config '{"mode": 0}'`, as vLLM) captures the eager model; a model that does not
compile is captured eagerly too, with a warning.

The capture itself is a backend (`GraphCapture`): `CudaGraphCapture` on a GPU; `CallThrough` on
CPU, which runs the same buffers and padding through the model at every replay, so the whole path
is tested where CI runs.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from engine.models.attention import GatheredDecodeMetadata, GroupTables
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.worker.decode_graphs import MIN_ROWS, batch_sizes
from engine.worker.precompiled_graph import agreement_tolerance, compiled_and_agrees, room_to_recompile

logger = logging.getLogger(__name__)

# A captured graph's gathered keys and values hold size x width x block_size tokens per layer
# call; graphs whose product exceeds this many tokens are not captured (those steps run eagerly).
GATHER_TOKEN_BUDGET = 1 << 19
FIRST_WIDTH_TOKENS = 256  # the narrowest table captured, in tokens; each next width is 4x wider


def padded_size(count: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the (ascending) `sizes` that holds `count`; None if none does."""
    i = bisect.bisect_left(sizes, count)
    return sizes[i] if i < len(sizes) else None


def table_widths(max_blocks: int, block_size: int) -> tuple[int, ...]:
    """The block-table widths graphs are captured at: FIRST_WIDTH_TOKENS, 4x that, ..., up to the
    widest table a sequence of max_model_len tokens needs."""
    width = max(1, FIRST_WIDTH_TOKENS // block_size)
    widths = []
    while width < max_blocks:
        widths.append(width)
        width *= 4
    return (*widths, max_blocks)


class GraphCapture(Protocol):
    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `run` (which reads and writes fixed buffers only); returns its replay, which
        returns the same output tensor each time, refilled."""


class CallThrough:
    """No capture: each replay calls `run` again, over the same buffers (CPU, and tests)."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        run()
        return run


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (captured largest first, so the smaller
    ones reuse the largest one's memory, as vLLM captures)."""

    def __init__(self) -> None:
        self.pool: Any = None  # the first graph's pool handle

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy initialisation, allocator
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class CapturedDecode:
    """The decode step of one model over one KV cache as captured graphs (see the module doc).
    The same face as `DecodeGraphs`: `takes`, `run`, `compute_logits`, `steps_run`."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int, scratch_block: int,
                 capture_sizes: Sequence[int], max_blocks: int, capture: GraphCapture,
                 compile_model: bool = False) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        sizes = batch_sizes(capture_sizes)
        if compile_model:  # no graph of one row: it runs on the graph of two (see the module doc)
            sizes = tuple(size for size in sizes if size >= MIN_ROWS) or (MIN_ROWS,)
        self.sizes = sizes
        # What a graph runs: the compiled decoder (compiled at its first call, the largest capture's
        # warm-up) or the eager one.
        self._decoder: Callable[..., torch.Tensor] = compiled_decoder(model) if compile_model else model
        self.compiled = compile_model  # false once a compile failed (tests, the start-up line)
        self.widths = table_widths(max_blocks, block_size)
        self._capture = capture
        device, largest, widest = model.device, self.sizes[-1], self.widths[-1]
        self._hidden = torch.zeros(largest, model.config.hidden_size, dtype=model.dtype, device=device)
        self._positions = torch.zeros(largest, dtype=torch.long, device=device)
        groups = model.kv_layout.num_groups  # each KV cache group has its slots and tables (engine/kv_groups.py)
        self._slots = torch.zeros(groups, largest, dtype=torch.long, device=device)
        self._seq_lens = torch.ones(largest, dtype=torch.long, device=device)
        # One column past the widest table, never read: every width's view then has the same row
        # stride, which the compiled decoder's guards would otherwise tell apart (a recompile).
        self._tables = torch.full((groups, largest, widest + 1), scratch_block, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.steps_run = 0  # decode steps served by a graph (tests, metrics)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def shape_for(self, count: int, blocks: int) -> tuple[int, int] | None:
        """The captured (size, width) a step of `count` decodes whose longest table has `blocks`
        blocks replays on; None if none is captured for it (the step runs eagerly)."""
        size = padded_size(count, self.sizes)
        width = padded_size(blocks, self.widths)
        if size is None or width is None or (size, width) not in self._graphs:
            return None
        return size, width

    def takes(self, count: int, blocks: int) -> bool:
        return self.shape_for(count, blocks) is not None

    def shapes(self) -> list[tuple[int, int]]:
        """Every (size, width) captured: at each width, the sizes within GATHER_TOKEN_BUDGET (the
        smallest size always)."""
        return [(size, width) for width in self.widths for size in self.sizes
                if size == self.sizes[0] or size * width * self.block_size <= GATHER_TOKEN_BUDGET]

    def capture_all(self, progress: Callable[[str], None] = logger.info) -> float:
        """Capture every graph (largest first); returns the seconds it took. Once, at start-up."""
        start = time.perf_counter()
        shapes = sorted(self.shapes(), key=lambda s: (s[0] * s[1], s), reverse=True)
        with torch.inference_mode():
            first, *rest = shapes
            self._graphs[first] = self._capture_first(*first, progress)
            for size, width in rest:
                self._graphs[size, width] = self._capture.capture(self._forward(size, width))
        seconds = time.perf_counter() - start
        what = "compiled decoder" if self.compiled else "eager decoder"
        progress(f"captured {len(shapes)} decode graphs of the {what} (batch sizes {self.sizes[0]}-{self.max_batch}, "
                 f"{len(self.widths)} table widths up to {self.widths[-1] * self.block_size} tokens) "
                 f"in {seconds:.1f} s")
        return seconds

    def _capture_first(self, size: int, width: int, progress: Callable[[str], None]) -> Callable[[], torch.Tensor]:
        """The first graph, whose warm-up compiles the decoder. A decoder that does not compile, or
        whose compiled output disagrees with the eager one's, is captured eagerly instead."""
        if self.compiled:
            started = time.perf_counter()
            if compiled_and_agrees(lambda: self._compiled_agrees(size, width), "compiled decoder",
                                   "CUDA graphs capture the eager model"):
                progress(f"compiled the decoder with torch.compile in {time.perf_counter() - started:.1f} s")
            else:
                self._decoder, self.compiled = self.model, False
        return self._capture.capture(self._forward(size, width))

    def _compiled_agrees(self, size: int, width: int) -> bool:
        """Compile the decoder (its first call, at the first capture's shape), then check it against
        the eager model on two random rows of another shape (so the batch is seen to be dynamic)
        in the scratch block: the first row attending to itself, the second to both."""
        groups = self._slots.shape[0]
        self._fill_metadata([([], [])] * groups, [], size, width)
        self._forward(size, width)()
        first, rows = self.scratch_block * self.block_size, MIN_ROWS
        self._fill_metadata([([first, first + 1], [[self.scratch_block]] * rows)] * groups, [1, 2], rows,
                            self.widths[0])
        generator = torch.Generator(device=self._hidden.device).manual_seed(0)
        self._hidden[:rows].copy_(torch.randn(self._hidden[:rows].shape, generator=generator,
                                              device=self._hidden.device))
        got = self._forward(rows, self.widths[0])().float()
        want = self.model(*self._inputs(rows, self.widths[0])).float()
        self._hidden[:rows].zero_()
        tolerance = agreement_tolerance(self.model)
        return bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp_min(1e-6)) < tolerance

    def run_largest(self) -> torch.Tensor:
        """The shape with the most gathered tokens, run once uncaptured: what its graph's memory
        pool holds (engine/worker/gpu_memory.py profiles it)."""
        size, width = max(self.shapes(), key=lambda shape: shape[0] * shape[1])
        return self._forward(size, width)()

    def _forward(self, size: int, width: int) -> Callable[[], torch.Tensor]:
        """The model's decode over the first `size` rows and `width` table columns of the buffers."""
        inputs = self._inputs(size, width)
        return lambda: self._decoder(*inputs)

    def _inputs(self, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, list[KVCache],
                                                      GatheredDecodeMetadata]:
        """The decoder's arguments: views of the first `size` rows and `width` table columns of the
        buffers. For the compiled decoder their batch and width are dynamic: one graph serves all."""
        slots, tables = self._slots[:, :size], self._tables[:, :size, :width]
        if slots.shape[0] == 1:  # one group: the shapes every model without one has
            slots, tables = slots[0], tables[0]
        seq_lens, hidden, positions = self._seq_lens[:size], self._hidden[:size], self._positions[:size]
        if self.compiled:
            for tensor, dim in ((hidden, 0), (positions, 0), (seq_lens, 0), (slots, -1), (tables, -2), (tables, -1)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())
        return hidden, positions, self.kv_caches, GatheredDecodeMetadata(slots, tables, seq_lens, self.block_size)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], seq_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]], other_groups: Sequence[GroupTables] | None = None) -> torch.Tensor:
        """One decode step of `len(slots)` sequences (as `DecodeGraphs.run`): the inputs copied into
        the buffers, padding rows pointed at the scratch block, the graph replayed. Returns the real
        rows' final hidden states (a view of the graph's output: read it before the next step)."""
        count = len(slots)
        groups = [(slots, block_tables),
                  *([(slots, block_tables)] * (self._slots.shape[0] - 1) if other_groups is None else other_groups)]
        shape = self.shape_for(count, max(len(t) for _, tables in groups for t in tables))
        assert shape is not None, "no graph for this step: the caller checks takes() first"
        size, width = shape
        self._hidden[:count].copy_(hidden[:count])
        self._positions[:count].copy_(positions[:count])
        self._fill_metadata(groups, seq_lens, size, width)
        out = self._graphs[shape]()
        self.steps_run += 1
        return out[:count]

    def _fill_metadata(self, groups: Sequence[GroupTables], seq_lens: Sequence[int], size: int, width: int) -> None:
        """Slots, lengths and tables of the real rows, the scratch block for the rest: one host
        tensor each, copied in without waiting for the device."""
        count, scratch = len(seq_lens), self.scratch_block
        pad = size - count
        slots = torch.tensor([[*group_slots, *[scratch * self.block_size] * pad] for group_slots, _ in groups],
                             dtype=torch.long)
        # One tensor from nested lists: filling it a row at a time cost ~10 us a row (2.6 ms a
        # step at 256 rows on the H200 machine's host).
        padding_row = [scratch] * width
        table = torch.tensor([[[*blocks, *padding_row[len(blocks):]] for blocks in tables] + [padding_row] * pad
                              for _, tables in groups], dtype=torch.long)
        pinned = torch.cuda.is_available() and self._slots.is_cuda
        lengths = torch.tensor([*seq_lens, *[1] * pad], dtype=torch.long)
        for buffer, values in ((self._slots[:, :size], slots), (self._seq_lens[:size], lengths),
                               (self._tables[:, :size, :width], table)):
            buffer.copy_(values.pin_memory() if pinned else values, non_blocking=pinned)
        self._hidden[count:size].zero_()
        self._positions[count:size].zero_()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def compiled_decoder(model: DecoderForCausalLM) -> Callable[..., torch.Tensor]:
    """The decoder under `torch.compile` (inductor, one graph: a break would be a bug to see, not
    a graph to capture in pieces), compiled at its first call."""
    return room_to_recompile(torch.compile(model, fullgraph=True, dynamic=False))


def max_table_blocks(max_model_len: int, block_size: int) -> int:
    """The widest block table a sequence of `max_model_len` tokens needs."""
    return math.ceil(max_model_len / block_size)
