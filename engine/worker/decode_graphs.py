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

The LM head runs outside the graph (only the sampled rows need logits). An int8 head gets a
compiled graph of its own (`compute_logits`): at one row inductor's product-and-sum reads it at
twice the rate of torch's int8 kernel (engine/models/quantized_linear.py).

Padding rows write their keys and values into a scratch block kept for them past the end of
the KV cache (the worker allocates it), and attend only to it: they can neither read nor
clobber a real sequence's cache, so padding never leaks into outputs.

The graph of a dense model is exported and compiled ahead of time into an AOTInductor package
(`precompiled_graph`): a restart loads it in milliseconds, without tracing and without importing
the compiler (re-tracing took 2.3 s, dynamo's saved form 0.6 s plus 2.1 s of imports). An MoE model's graphs,
broken around its eager experts, go through `torch.compile`, and inductor's on-disk caches spare
a restart the compiling but not the tracing. Both live under `cache_dir` (default
`$XDG_CACHE_HOME/trio-llm/torch_compile`, by default `~/.cache/trio-llm/torch_compile`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.models.attention import DecodeMetadata, GroupTables
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.models.packed_linear import register_inductor_lowering
from engine.paths import default_compile_cache
from engine.worker import precompiled_graph
from engine.worker.precompiled_graph import DecodeStep, HeadStep

logger = logging.getLogger(__name__)

def use_compile_cache(cache_dir: str | None) -> Path:
    """Point inductor's on-disk caches at `cache_dir` (or ours), unless the user already has;
    returns the directory. Imports no compiler: a warm start loads its graph without one.

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks a graph up, so setting it before
    the first compilation is enough; it is process-wide, as the cache is. (The first time
    inductor looks for its cache it fixes the variable to its own default, /tmp/torchinductor_USER,
    which is why this runs before anything imports inductor.)"""
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_compile_cache()))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def prepare_inductor() -> None:
    """Before compiling: inductor's files under its own cache directory (see `keep_headers_in`)
    and its vector instruction sets settled (`settle_vector_isa`).

    Inductor's directory (TORCHINDUCTOR_CACHE_DIR, which `use_compile_cache` points at the
    engine's compile cache), not the directory a graph's package is saved in: the headers and the
    probe depend on the compiler and its flags alone, and a fresh package directory (each test's)
    would otherwise build them again, ~28 s on 2 cores (15 s of headers, 13 s of probes)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inductors = Path(cache_dir())
    keep_headers_in(inductors)
    settle_vector_isa(inductors)


def keep_headers_in(cache_dir: Path) -> None:
    """Inductor's precompiled C++ headers (~300 MB per compiler and flag set) go under `cache_dir`
    with the rest of its cache. Inductor fixes their directory when it is imported, from the
    system's temporary directory (/tmp/torchinductor_USER), whatever TORCHINDUCTOR_CACHE_DIR says;
    so that directory is moved here, before anything is compiled. (A private name of inductor's:
    if a torch release drops it, the headers go back to /tmp and nothing else changes.)"""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = str(cache_dir / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = str(cache_dir / "precompiled_headers" / "locks")


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


# The first compile of a model's two graphs (decode and step), measured on 2 cores: 57 s for a
# tiny model, 108 s for the Qwen2.5-0.5B shape (docs/benchmarks.md, "A newcomer's first hour"). A fixed part
# (inductor's headers and wrapper code), and a part that grows with the weights' kernels.
COMPILE_FIXED_SECONDS, COMPILE_SECONDS_PER_MILLION_PARAMETERS = 55.0, 0.1


def compile_estimate(parameters: int) -> str:
    """What the first compile of a model with `parameters` weights is likely to take, in words."""
    seconds = COMPILE_FIXED_SECONDS + COMPILE_SECONDS_PER_MILLION_PARAMETERS * parameters / 1e6
    return f"about {round(seconds / 10) * 10:.0f} s on 2 cores for this model's size"


RECOMPILE_NOTE = ("Each new model, dtype, quantization, LoRA set or KV cache size compiles once more; each "
                  "compiled graph is kept.")


MIN_ROWS = 2  # dynamo specialises a dimension of size 1: on its graph one row is padded to two
TRACE_ROWS = 64  # the rows the graph is traced with (see compile_all)


def batch_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """The decode batch sizes graphs run at, ascending and distinct; `ValueError` unless positive."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"decode batch sizes must be positive, got {list(sizes)}")
    return tuple(sorted(set(sizes)))


class DecodeGraphs:
    """The compiled decode graph of one model over one KV cache.

    `scratch_block`: a block id no sequence is ever given (the worker allocates one past the
    scheduler's blocks); padding rows use it. `capture_sizes`: the largest is the largest batch
    the graph runs (the rest warm up a torch.compile graph at start-up). `cache_dir`: where a dense model's
    graph is packaged (None: compiled at each start, not saved)."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                 scratch_block: int, capture_sizes: Sequence[int], cache_dir: Path | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture_sizes = batch_sizes(capture_sizes)
        self.cache_dir = cache_dir
        self.num_kv_groups = model.kv_layout.num_groups
        device = model.device
        self.device = device
        for experts in model.moe_layers:
            experts.exclude_from_compilation()
        # The graph of a dense model, compiled ahead of time (compile_all). MoE models cannot be:
        # their experts break the graph.
        self._step: DecodeStep | None = None
        self._dynamo: Callable[..., torch.Tensor] | None = None
        # The LM head compiled alone, where that beats running it eagerly: int8 at one row.
        self._head: HeadStep | None = None
        if model.moe_layers:
            self._use_dynamo()
        self.loaded_from_disk = False  # whether compile_all found the graph saved (tests)
        self.steps_run = 0  # decode steps served by a compiled graph since start-up (tests, metrics)

    def _use_dynamo(self) -> None:
        """`torch.compile` with its guards, for a model that does not export into one graph."""
        prepare_inductor()
        register_inductor_lowering()
        self._dynamo = precompiled_graph.room_to_recompile(
            torch.compile(self.model, dynamic=False, fullgraph=False, options={"cpp.dynamic_threads": True}))

    @property
    def max_batch(self) -> int:
        return self.capture_sizes[-1]

    def takes(self, count: int, blocks: int) -> bool:
        """Whether a step of `count` decodes runs on the graph (any table width does)."""
        return count <= self.max_batch

    def saved_on_disk(self) -> bool:
        """Whether a start would load this graph (and the LM head's, where it has one) rather than
        compile it: packages filed under their names exist (a stale one is still caught at load)."""
        if self.cache_dir is None or self.model.moe_layers:
            return False  # MoE: torch.compile, which traces at each start
        kinds = ("decode", "head") if self._head_wants_compiling() else ("decode",)
        return all(precompiled_graph.artefact_path(self.cache_dir, self.model, self.kv_caches, self.block_size,
                                                   TRACE_ROWS, kind).exists() for kind in kinds)

    @property
    def min_rows(self) -> int:
        """The fewest rows a step runs with: one on the exported graph, two on dynamo's."""
        return 1 if self._step is not None else MIN_ROWS

    def compile_all(self, progress: Callable[[str], None] = logger.info) -> float:
        """Compile (or load from disk) the graph; a torch.compile graph is then warmed at every
        size (the batch is dynamic: no size compiles again later), while a package has run in its
        agreement check. Returns the seconds it took. Called once, at start-up."""
        with torch.inference_mode():
            return self._compile_all(progress)

    def _compile_all(self, progress: Callable[[str], None]) -> float:
        start = time.perf_counter()
        if self._dynamo is None:
            self._step = self._precompiled_step(progress)
            if self._step is None:
                progress("compiling the decode graph with torch.compile (a few seconds)")
                self._use_dynamo()
            elif self._head_wants_compiling():
                self._head = self._precompiled_head()
        sizes = sorted({self.min_rows, *self.capture_sizes}, reverse=True)
        # Traced first at TRACE_ROWS rows whatever the sizes (the saved graph too, in
        # _precompiled_step): inductor sizes its parallel loops by
        # the sizes it traces with, and its cache key does not include them. A graph traced at
        # two rows ran single-threaded kernels at every size (13.7 against 12.1 ms a step at
        # batch 64 on two threads, 5.4 against 3.6 at 16), and a cached one would be reused so.
        # A package is one graph for every size, already run at one and two rows by its agreement
        # check: nothing is left to warm (a run at the largest size was 1.3 s of the 0.5B shape's
        # warm start: the first touch of a 64-row step's memory, which the first such step pays
        # if one ever comes). Dynamo's graph runs every size at two widths, so that none
        # recompiles later (the second width proves the width dynamic).
        if self._dynamo is not None:
            self._warm_every_size(sizes)
        how = "loaded" if self.loaded_from_disk else "compiled"
        progress(f"{how} the decode graph (batch sizes 1-{self.max_batch}) in {time.perf_counter() - start:.1f} s")
        return time.perf_counter() - start

    def _warm_every_size(self, sizes: list[int]) -> None:
        for rows in [TRACE_ROWS, *sizes]:
            for width in (8, 2):
                self.run(*self._scratch_rows(rows, width))

    def _precompiled_step(self, progress: Callable[[str], None]) -> DecodeStep | None:
        """The saved graph if there is one and it agrees with the eager model; else exported,
        compiled and saved; None when the model does not export or compile so (logged: it then
        runs on `torch.compile`)."""
        path, step = precompiled_graph.saved(self.cache_dir, self.model, self.kv_caches, self.block_size, TRACE_ROWS,
                                             "decode", self._agrees_with_eager)
        if step is not None:
            self.loaded_from_disk = True
            return step
        if refused_before(path, "decode"):
            return None
        prepare_inductor()
        hidden, positions, *_ = self._scratch_rows(TRACE_ROWS, 8)
        meta = self._metadata(TRACE_ROWS, [], [], [], 8)
        estimate = compile_estimate(sum(p.numel() for p in self.model.parameters()))
        progress(f"compiling the decode and step graphs with AOTInductor: {estimate}; later starts load them from "
                 f"{self.cache_dir or 'a temporary directory'} in seconds. {RECOMPILE_NOTE} (--enforce-eager skips "
                 "compiling)")
        try:
            return precompiled_graph.compile_and_save(path, self.model, (hidden, positions, self.kv_caches, meta))
        except Exception as exc:  # noqa: BLE001 -- export refuses many things; torch.compile takes them
            logger.warning("the decode graph does not export (%s: %s); compiling it with torch.compile instead",
                           type(exc).__name__, exc)
            note_refusal(path, exc)
            return None

    @property
    def head_compiled(self) -> bool:
        """Whether the LM head runs a compiled graph of its own (`_head_wants_compiling`)."""
        return self._head is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `compute_logits`, through the compiled LM head if there is one."""
        return self.model.compute_logits(hidden, self._head)

    def _head_wants_compiling(self) -> bool:
        """An int8 LM head (the largest layer of a small model) at one row runs twice as fast
        compiled as torch's kernel runs it (quantized_linear.py, `int8_row_times`); a q8_0 head has
        no eager kernel at all for one row (eagerly it dequantizes the whole table each step); float
        heads are as fast eagerly (oneDNN's packed weights)."""
        head = self.model.lm_head
        return head is not None and head.qmethod in ("int8", "q8_0") and head.lora is None

    def _precompiled_head(self) -> HeadStep | None:
        """The LM head's graph: saved, or exported, compiled and saved (a few seconds); None when
        it does not compile (logged: the head then runs eagerly)."""
        path, head = precompiled_graph.saved(self.cache_dir, self.model, self.kv_caches, self.block_size, TRACE_ROWS,
                                             "head", self._head_agrees_with_eager)
        if head is not None:
            return head
        hidden = torch.zeros(TRACE_ROWS, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        try:
            return precompiled_graph.compile_and_save_head(path, self.model, hidden)
        except Exception as exc:  # noqa: BLE001 -- the eager head serves as well, only slower
            logger.warning("the LM head does not compile (%s: %s); it runs eagerly", type(exc).__name__, exc)
            return None

    def _head_agrees_with_eager(self, head: HeadStep) -> bool:
        """Whether `head` computes the eager LM head's logits, on two rows and on one."""
        assert self.model.lm_head is not None
        hidden = self._random_rows()
        want = self.model.lm_head(hidden).float()
        try:
            pairs = [(head(hidden).float(), want), (head(hidden[:1]).float(), want[:1])]
        except Exception:  # noqa: BLE001 -- a graph for other shapes may fail any way it likes
            return False
        return self._close(pairs)

    def _random_rows(self) -> torch.Tensor:
        """Two hidden rows the agreement checks feed a graph and the eager model (seeded)."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        hidden = torch.randn(MIN_ROWS, self.model.config.hidden_size, generator=generator, device=self.device)
        return hidden.to(self.model.dtype)

    def _close(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether each (compiled, eager) pair agrees within rounding (`agreement_tolerance`)."""
        tolerance = precompiled_graph.agreement_tolerance(self.model)
        return all(float((got - want).norm() / want.norm().clamp_min(1e-6)) < tolerance for got, want in pairs)

    def _agrees_with_eager(self, step: DecodeStep) -> bool:
        """Whether `step` computes what the eager model does, on two rows in the scratch block
        (distinct slots, the second attending to both)."""
        hidden = self._random_rows()
        positions = torch.arange(MIN_ROWS, device=self.device)
        first = self.scratch_block * self.block_size
        meta = self._metadata(MIN_ROWS, [first, first + 1], [1, 2], [[self.scratch_block]] * 2, MIN_ROWS)
        want = self.model(hidden, positions, self.kv_caches, meta).float()
        # The first row attends to itself alone, so it alone must give the same: that runs the
        # graph's one-row branches (int8 layers have their own kernel for one row).
        one_row = self._metadata(1, [first], [1], [[self.scratch_block]], MIN_ROWS)
        try:
            pairs = [(step(hidden, positions, self.kv_caches, meta).float(), want),
                     (step(hidden[:1], positions[:1], self.kv_caches, one_row).float(), want[:1])]
        except Exception:  # noqa: BLE001 -- a graph for other shapes may fail any way it likes
            return False
        return self._close(pairs)

    def _scratch_rows(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int],
                                                             list[list[int]], int]:
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        return hidden, positions, [], [], [], width

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slots: Sequence[int],
            seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], padded_width: int = 2,
            other_groups: Sequence[GroupTables] | None = None) -> torch.Tensor:
        """One decode step of `len(slots)` sequences: `hidden` [n, H] their input embeddings,
        `positions` [n], each one's new slot, length (with the new token) and block table.
        `other_groups`: each further KV cache group's slots and block tables (None: the same as
        the first group's). `hidden` and `positions` may carry more rows than sequences (all
        padding). Returns the final hidden states of the real rows. The caller checks
        `max_batch` first."""
        count = len(slots)
        rows = max(hidden.shape[0], count, self.min_rows)
        assert count <= self.max_batch, "batch above the largest size: the caller runs eagerly"
        pad = rows - hidden.shape[0]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        meta = self._metadata(rows, slots, seq_lens, block_tables, padded_width, other_groups)
        if self._step is not None:
            out = self._step(hidden, positions, self.kv_caches, meta)
        else:
            out = self._run_dynamo(hidden, positions, meta)
        if count:
            self.steps_run += 1
            return out[:count]
        return out

    def metadata(self, rows: int, slots: Sequence[int], seq_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]]) -> DecodeMetadata:
        """A step's metadata as `run` builds it (one KV cache group: the caller's tables serve
        all), for a caller that keeps it and writes later steps' slots and lengths in place
        (`LeanBurst`)."""
        return self._metadata(rows, slots, seq_lens, block_tables, MIN_ROWS)

    def run_prepared(self, hidden: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        """One decode step on inputs the caller built and keeps (`metadata`): every row of
        `hidden`, padding included, is returned."""
        out = self._step(hidden, positions, self.kv_caches, meta) if self._step is not None else \
            self._run_dynamo(hidden, positions, meta)
        self.steps_run += 1
        return out

    def _run_dynamo(self, hidden: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        assert self._dynamo is not None, "compile_all() first"
        for batched in (hidden, positions, meta.seq_lens):
            torch._dynamo.maybe_mark_dynamic(batched, 0)
        groups = meta.slot_mapping.dim() - 1  # a leading KV cache group dimension, or none
        torch._dynamo.maybe_mark_dynamic(meta.slot_mapping, groups)
        torch._dynamo.maybe_mark_dynamic(meta.block_table, groups)
        torch._dynamo.maybe_mark_dynamic(meta.block_table, groups + 1)
        return self._dynamo(hidden, positions, self.kv_caches, meta)

    def _metadata(self, rows: int, slots: Sequence[int], seq_lens: Sequence[int],
                  block_tables: Sequence[Sequence[int]], min_width: int,
                  other_groups: Sequence[GroupTables] | None = None) -> DecodeMetadata:
        """`rows` rows, the real ones first; with several KV cache groups, slots and tables get a
        leading group dimension (`other_groups` None: every group as the first)."""
        others = [(slots, block_tables)] * (self.num_kv_groups - 1) if other_groups is None else other_groups
        groups = [(slots, block_tables), *others]
        # Width at least 2: dynamo specialises a dimension of size 1, which would compile again.
        width = max([min_width, *(len(t) for _, tables in groups for t in tables)])
        scratch, pad = self.scratch_block, rows - len(slots)
        scratch_slot = scratch * self.block_size
        slot_rows = [[*group_slots, *[scratch_slot] * pad] for group_slots, _ in groups]
        table_rows = [[list(t) + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width] * pad
                      for _, tables in groups]
        one = len(groups) == 1
        return DecodeMetadata(
            torch.tensor(slot_rows[0] if one else slot_rows, dtype=torch.long, device=self.device),
            torch.tensor(table_rows[0] if one else table_rows, dtype=torch.long, device=self.device),
            torch.tensor([*seq_lens, *[1] * pad], dtype=torch.long, device=self.device),
            self.block_size)



def refusal_marker(package: Path) -> Path:
    """Beside where a graph's package would be: the note that it did not export or load on this
    machine. Its name carries the package's digest (the model, the shapes, the traced code), so a
    change of any of them tries the export again. (An int4 model's packages once compiled and then
    did not load: without the note every start spent ~55 s compiling them again on the small Llama.)"""
    return package.with_name(package.name + ".torch-compile")


def refused_before(package: Path | None, kind: str) -> bool:
    """Whether the `kind` graph at `package` did not export or load here before (logged)."""
    if package is None or not refusal_marker(package).exists():
        return False
    logger.info("the %s graph is not exported: it did not export or load here before (%s)", kind,
                refusal_marker(package))
    return True


def note_refusal(package: Path | None, error: BaseException) -> None:
    """Remember that the graph at `package` did not export or load (`refused_before`). Without the
    note the next start tries again: slower, no worse."""
    if package is None:
        return
    with contextlib.suppress(OSError):
        refusal_marker(package).parent.mkdir(parents=True, exist_ok=True)
        refusal_marker(package).write_text(f"{type(error).__name__}: {error}\n")
