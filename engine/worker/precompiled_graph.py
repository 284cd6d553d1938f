"""The decode graph compiled ahead of time into a package on disk (AOTInductor), so a warm start
loads it without tracing and without importing the compiler.

A warm start through `torch.compile` re-traces the model with dynamo and then finds the compiled
code in inductor's caches: ~2.3 s. Dynamo's own saved form (`torch.compile(...).aot_compile`,
vLLM's `torch_aot_compile` cache) skips the tracing, but loading it runs inductor's Python
wrapper, which imports dynamo and inductor (~2.1 s of the engine process's start-up, serial).
Here the decode forward is exported (`torch.export`, the batch and the block table's width
dynamic) and compiled by AOTInductor into a `.pt2` package: a shared library and its metadata.
Loading it is torch's C++ loader (`torch._C._aoti.AOTIModelPackageLoader`, what
`torch._inductor.aoti_load_package` wraps): milliseconds, and no dynamo or inductor import.

The package holds no weights (`package_constants_in_so=False`): at load the model's own
parameters and buffers are handed to it by name, without copying (`user_managed`), so the file
stays small and the graph computes with the tensors the eager path uses. The linears' oneDNN-packed
weights (engine/models/packed_linear.py) are opaque tensors AOTInductor cannot hold as constants:
the graph takes them as inputs after the step's own, in `model.packed_linears` order.

The package keeps no guards. What they would have checked goes into the file's name instead
(`artefact_path`): torch and Python, the model's configuration, parameter shapes and dtypes, the
rotary tables, the KV cache's shape, the block size, the vector ISA, the LoRA slot layout, and
the source of the modeling and LoRA code. (Not the thread count: the graph's C++ loops read it at each call,
`cpp.dynamic_threads`.) A stale package
the key misses is caught at load: `DecodeGraphs` compares one step against the eager model and
compiles again on a mismatch.

The loader unpacks the package's shared library into a new `aotinductor_*` directory under TMPDIR
and never removes it (1.9 MB a start); `load` unpacks into a directory of ours and removes it once
the library is loaded (a loaded library needs no file). Packages are kept most recently used
first, at most `KEEP_PACKAGES` of them (`prune`).

The step graph (engine/worker/step_graph.py) is packaged the same way, under `step-graphs/`, and
so is an int8 LM head (`compile_and_save_head`, under `head-graphs/`).

Only a model that exports into one graph is compiled so; MoE models, whose experts run eagerly
between graphs, keep `torch.compile`, and so does a model whose export fails (logged).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import engine.lora
import engine.models
from engine.kernels import native, paged_decode, q4_rows, q8_0_rows
from engine.lora.serving import LinearLoRA, graph_inputs, traced_inputs
from engine.models.attention import GRAPHED, DecodeMetadata
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.models.layers import Linear
from engine.models.packed_linear import register_inductor_lowering
from engine.models.quantized_linear import native_bfloat16
from engine.worker import aoti_runner

logger = logging.getLogger(__name__)

FORMAT = 7  # bump when what is saved, or how it is called, changes (1: dynamo's aot_compile; 2: fixed threads;
# 3: LoRA as an op; 4: one row padded to two; 5: one row as it is; 6: q8_0's one row on our kernel;
# 7: decode attention on our kernel)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, list[KVCache], DecodeMetadata], torch.Tensor]
GraphedStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, positions) inside `attention_step`
HeadStep = Callable[[torch.Tensor], torch.Tensor]  # final hidden rows -> this rank's logits
MAX_ROWS = 1 << 16  # the exported graph's bounds on the batch and the table's width (AOTI checks them)
MAX_TABLE_WIDTH = 1 << 20
# No weights in the package (see the module doc), and C++ loops that use as many threads as torch
# has at each call rather than those it had when compiled: the worker changes the count while
# serving (engine/worker/thread_tuner.py).
# Our kernels' graph operators are called through their C shims (engine/kernels/block_rows.py).
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False, "cpp.dynamic_threads": True,
                    "aot_inductor.custom_ops_to_c_shims": {**q8_0_rows.c_shims(), **q4_rows.c_shims(),
                                                           **paged_decode.c_shims()}}
KEEP_PACKAGES = 16  # compiled graphs kept on disk (one per model, dtype, cache shape, torch, ...)

# torch 2.13's own pytree code warns when an exported program is pickled or loaded; not ours to fix.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


def artefact_path(cache_dir: Path, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                  trace_rows: int, kind: str = "decode") -> Path:
    """Where the `kind` graph ("decode", "step" or "head") of `model` over caches shaped as `kv_caches` is
    kept: its name is a digest of everything the compiled code depends on (see the module doc)."""
    assert model.rope is not None, "setup_rope() before compiling"
    parts = (
        FORMAT, kind, torch.__version__, sys.version, torch.backends.cpu.get_cpu_capability(),
        os.environ.get("TORCHINDUCTOR_VEC_ISA_OK"), native_bfloat16(),
        repr(model.config), str(model.dtype), block_size, trace_rows,
        [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()],
        [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()],
        [name for name, _ in model.packed_linears],
        [(name, m.q8_0_activations) for name, m in model.named_modules()
         if getattr(m, "q8_0_activations", None) is not None],  # --q8-0-activations: each its own operator
        [(name, repr(m.lora)) for name, m in model.named_modules() if getattr(m, "lora", None) is not None],
        tuple(model.rope.cos.shape), [(tuple(k.shape), str(k.dtype), str(k.device)) for k, _ in kv_caches],
        _modeling_source_digest(),
    )
    return cache_dir / f"{kind}-graphs" / f"{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}.pt2"


# Modules of engine/models that no graph is traced from (make-model's checkpoints, the registry of
# architectures, reading files: what they read is in the key as the config and the parameters'
# shapes and dtypes): editing them must not make every compiled graph compile again.
NEVER_TRACED = frozenset({"tiny.py", "tiny_spec.py", "tiny_weights.py", "tiny_llava.py", "registry.py",
                          "gguf_file.py", "hf_config.py", "weights.py"})


def _modeling_source_digest() -> str:
    digest = hashlib.sha256()
    for module_dir in [*engine.models.__path__, *engine.lora.__path__]:  # the code a graph is traced from
        for source in sorted(Path(module_dir).glob("*.py")):
            if source.name in NEVER_TRACED:
                continue
            digest.update(source.name.encode())
            digest.update(source.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def load(path: Path, model: DecoderForCausalLM, kind: str = "decode") -> Any:
    """The `kind` step packaged at `path` (a `DecodeStep`, `GraphedStep` or `HeadStep`), over `model`'s own
    tensors; None when there is none or it cannot be loaded (why is logged; the caller compiles
    again and overwrites it)."""
    if not path.exists():
        return None
    try:
        loader = _loaded(path, _model_tensors(model), model.device)
        os.utime(path)  # most recently used: `prune` keeps it
    except Exception as exc:  # noqa: BLE001 -- any unreadable or foreign package: compile again
        logger.warning("could not load the compiled %s graph %s (%s: %s); compiling it again",
                       kind, path, type(exc).__name__, exc)
        return None
    if kind == "head":
        return _bind_head(loader)
    packed = [linear.packed for _, linear in model.packed_linears]
    linears = lora_linears(model)
    return _bind(loader, packed, linears) if kind == "decode" else _bind_graphed(loader, packed, linears)


def agreement_tolerance(model: DecoderForCausalLM) -> float:
    """How far (relative norm) a compiled graph's output may stray from the eager model's on the
    random rows the checks feed it. A wrong graph is off by the order of the output itself; a
    right one drifts by rounding, amplified over the layers of a random model: under 1% in float32,
    but 4.8% in bfloat16, 1.1% with int8 activations and 1.2% between int8 weight-only's one-row
    kernel and torch's (each rounds bfloat16 activations and results its own way) over the 0.5B
    shape's 24 layers (measured), so reduced precision (bfloat16 or float16, any quantized layer)
    gets 10%."""
    reduced = model.dtype != torch.float32 or any(getattr(m, "qmethod", None) is not None for m in model.modules())
    return 0.1 if reduced else 1e-2


def load_agreeing(path: Path, model: DecoderForCausalLM, kind: str, agrees: Callable[[Any], bool]) -> Any:
    """The `kind` graph saved at `path` if it loads and `agrees` with the eager model; else None
    (a saved graph that disagrees is logged: the caller compiles again and overwrites it)."""
    step = load(path, model, kind)
    if step is not None and agrees(step):
        return step
    if step is not None:
        logger.warning("the compiled %s graph %s disagrees with the model; compiling it again", kind, path)
    return None


def saved(cache_dir: Path | None, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
          trace_rows: int, kind: str, agrees: Callable[[Any], bool]) -> tuple[Path | None, Any]:
    """(where the `kind` graph is kept, the saved graph if it loads and `agrees`, else None);
    (None, None) without a cache directory (compiled at each start)."""
    if cache_dir is None:
        return None, None
    path = artefact_path(cache_dir, model, kv_caches, block_size, trace_rows, kind)
    return path, load_agreeing(path, model, kind, agrees)


def compile_and_save(path: Path | None, model: DecoderForCausalLM, example: tuple[Any, ...]) -> DecodeStep:
    """Export the decode step of `model` on `example` (hidden, positions, kv_caches, meta), compile
    it with AOTInductor into a package at `path` (written atomically; None: a temporary one) and
    load it. Raises what export or compilation raises."""
    hidden, positions, kv_caches, meta = example
    # Export, unlike dynamo, takes a batch of one in the same graph (traced at more rows): one row is
    # then not padded to two, and int8 layers can run their one-row kernel (quantized_linear.py).
    batch = torch.export.Dim("batch", min=1, max=MAX_ROWS)
    groups = meta.slot_mapping.dim() - 1  # a leading KV cache group dimension (engine/kv_groups.py), or none
    width = torch.export.Dim("table_width", min=2, max=MAX_TABLE_WIDTH)
    packed = [linear.packed for _, linear in model.packed_linears]
    lora, lora_shapes = _lora_example(model, min_rows=1)
    register_inductor_lowering()
    program = torch.export.export(
        _FlatDecodeStep(model, meta.block_size),
        (hidden, positions, kv_caches, meta.slot_mapping, meta.block_table, meta.seq_lens, packed, lora),
        dynamic_shapes=({0: batch}, {0: batch}, [(None, None)] * len(kv_caches), {groups: batch},
                        {groups: batch, groups + 1: width}, {0: batch}, [None] * len(packed), lora_shapes),
        strict=False)
    step: DecodeStep = _package_and_load(program, path, model, "decode")
    return step


def compile_and_save_graphed(path: Path | None, model: DecoderForCausalLM, hidden: torch.Tensor,
                             positions: torch.Tensor) -> GraphedStep:
    """Export the step graph of `model` (any tokens: attention is the opaque `step_attention`,
    engine/models/attention.py) on `hidden` and `positions`, the token count dynamic; compile,
    package and load it as `compile_and_save` does."""
    tokens = torch.export.Dim("tokens", min=2, max=MAX_ROWS)
    packed = [linear.packed for _, linear in model.packed_linears]
    lora, lora_shapes = _lora_example(model)
    register_inductor_lowering()
    program = torch.export.export(_FlatGraphedStep(model), (hidden, positions, packed, lora),
                                  dynamic_shapes=({0: tokens}, {0: tokens}, [None] * len(packed), lora_shapes),
                                  strict=False)
    step: GraphedStep = _package_and_load(program, path, model, "step")
    return step


RECOMPILE_LIMIT = 64  # graphs a code object may cache before dynamo falls back (its default: 8)


def room_to_recompile(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` (a `torch.compile`d model or function) with room for `RECOMPILE_LIMIT` graphs of
    its code object at each call, not dynamo's 8: every model compiled in one process (a bench's,
    the tests') adds an entry to its forward's cache, and the ninth failed a fullgraph compile.
    torch 2.13 keeps dynamo's config per context (a ContextVar): set once, it is unset in the
    worker thread that compiles, so each call sets it in its own context (2 us; `config.patch`
    costs 100 us)."""
    config = torch._dynamo.config

    def call(*args: Any, **kwargs: Any) -> Any:
        if config.recompile_limit < RECOMPILE_LIMIT:
            config.recompile_limit = RECOMPILE_LIMIT
        return compiled(*args, **kwargs)
    return call


def compiled_and_agrees(check: Callable[[], bool], what: str, otherwise: str) -> bool:
    """Run `check`, whose first call of a `torch.compile`d graph compiles it and which says whether
    the graph agrees with the eager model. False when it does not compile (inductor refuses many
    things) or disagrees, with a warning naming `what` and what happens `otherwise`."""
    try:
        if check():
            return True
        logger.warning("the %s disagrees with the model; %s", what, otherwise)
    except Exception as exc:  # noqa: BLE001 -- whatever the compiler raises, the eager model serves
        logger.warning("the %s does not compile (%s: %s); %s", what, type(exc).__name__, exc, otherwise)
    return False


def jit_graphed_step(model: DecoderForCausalLM) -> GraphedStep:
    """The step graph of `model` under `torch.compile` (CUDA: no AOTInductor package there,
    engine/worker/cuda_graphs.py), compiled at its first call, the token count dynamic (a graph
    for every count from two). A dense model on one rank only: no packed weights, no adapters."""
    compiled = room_to_recompile(torch.compile(_FlatGraphedStep(model), fullgraph=True, dynamic=False))

    def step(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(hidden, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        out: torch.Tensor = compiled(hidden, positions, [], [])
        return out
    return step


def compile_and_save_head(path: Path | None, model: DecoderForCausalLM, hidden: torch.Tensor) -> HeadStep:
    """Export the LM head of `model` alone on `hidden` (any rows, one included), compile, package
    and load it as `compile_and_save` does."""
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    program = torch.export.export(_FlatHead(model), (hidden,), dynamic_shapes=({0: rows},), strict=False)
    step: HeadStep = _package_and_load(program, path, model, "head")
    return step


def _package_and_load(program: torch.export.ExportedProgram, path: Path | None, model: DecoderForCausalLM,
                      kind: str) -> Any:
    with tempfile.TemporaryDirectory() as scratch:
        target = path if path is not None else Path(scratch) / f"{kind}.pt2"
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.pt2")  # AOTI wants the suffix
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(partial), inductor_configs=INDUCTOR_CONFIGS)
            os.replace(partial, target)  # a reader sees the whole package or none
            prune(target.parent)
        finally:
            partial.unlink(missing_ok=True)  # a failed compile leaves nothing behind
        step = load(target, model, kind)
        if step is None:
            target.unlink(missing_ok=True)
            raise RuntimeError(f"the {kind} graph just compiled to {target} does not load")
    return step


def prune(directory: Path, keep: int = KEEP_PACKAGES) -> None:
    """Remove all but the `keep` most recently used packages in `directory`."""
    packages = sorted(directory.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in packages[keep:]:
        stale.unlink(missing_ok=True)


@contextlib.contextmanager
def _unpacked_in_a_directory_we_remove() -> Iterator[None]:
    """Point TMPDIR at a directory of ours while the C++ loader unpacks and loads the package
    (`std::filesystem::temp_directory_path` reads it), then remove what it unpacked."""
    scratch = tempfile.mkdtemp(prefix="trio-llm-aoti-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _packed_weights_from(model: DecoderForCausalLM, packed: list[torch.Tensor]) -> Iterator[None]:
    """While tracing, each layer reads its packed weight from the graph's inputs, so the graph
    holds none of them as a constant."""
    linears = [linear for _, linear in model.packed_linears]
    own = [linear.packed for linear in linears]
    for linear, given in zip(linears, packed, strict=True):
        linear.packed = given
    try:
        yield
    finally:
        for linear, weight in zip(linears, own, strict=True):
            linear.packed = weight


def lora_linears(model: DecoderForCausalLM) -> list[LinearLoRA]:
    """The model's LoRA-adapted linears, in index order (empty: the engine serves no adapters)."""
    found = {id(m.lora): m.lora for m in model.modules() if isinstance(m, Linear) and isinstance(m.lora, LinearLoRA)}
    return sorted(found.values(), key=lambda lora: lora.index)


def _lora_example(model: DecoderForCausalLM, min_rows: int = 2) -> tuple[list[torch.Tensor], list[Any]]:
    """The LoRA inputs a graph is exported with (engine/lora/serving.py, `graph_inputs`), and their
    dynamic shapes: the row layout's width is the one dynamic dimension."""
    linears = lora_linears(model)
    if not linears:
        return [], []
    rows = torch.export.Dim("lora_rows", min=min_rows, max=MAX_ROWS)
    return graph_inputs(linears), [{1: rows}, {1: rows}, *([None] * (2 * len(linears)))]


@contextlib.contextmanager
def _lora_from(model: DecoderForCausalLM, lora: list[torch.Tensor]) -> Iterator[None]:
    """While tracing, the adapters' delta reads its layout and stacks from the graph's inputs."""
    linears = lora_linears(model)
    if not linears:
        yield
        return
    n = len(linears)
    stacks = {linear.index: (lora[2 + i], lora[2 + n + i]) for i, linear in enumerate(linears)}
    with traced_inputs(lora[0], lora[1], stacks):
        yield


class _FlatDecodeStep(nn.Module):
    """The decode forward over plain tensors (export takes no dataclass of ours), the packed
    weights among its inputs."""

    def __init__(self, model: DecoderForCausalLM, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                packed: list[torch.Tensor], lora: list[torch.Tensor]) -> torch.Tensor:
        meta = DecodeMetadata(slot_mapping, block_table, seq_lens, self.block_size)
        with _packed_weights_from(self.model, packed), _lora_from(self.model, lora):
            out: torch.Tensor = self.model(hidden, positions, kv_caches, meta)
        return out


class _FlatGraphedStep(nn.Module):
    """Any step's forward with attention left opaque: no cache or metadata among its inputs (the
    op finds them, `attention_step`), the packed weights among them."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        super().__init__()
        self.model = model
        nothing = torch.empty(0)
        self.no_caches = [(nothing, nothing)] * model.num_kv_caches  # the graphed layers read none

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, packed: list[torch.Tensor],
                lora: list[torch.Tensor]) -> torch.Tensor:
        with _packed_weights_from(self.model, packed), _lora_from(self.model, lora):
            out: torch.Tensor = self.model(hidden, positions, self.no_caches, GRAPHED)
        return out


class _FlatHead(nn.Module):
    """The LM head alone (the model held as `model`, so its tensors keep their names)."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.model.lm_head is not None
        out: torch.Tensor = self.model.lm_head(hidden)
        return out


def _loaded(path: Path, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    """The package's runner over the model's `tensors` (by reference, not copied; a missing name
    raises): on CPU ours, which releases the GIL while the graph runs (engine/worker/aoti_runner.py),
    where the package and the process allow it (`aoti_runner.releases_the_gil`); else torch's loader."""
    if device.type == "cpu":
        native.load_graph_operators()  # a package may call our kernels' C shims (q8_0_rows.c)
    if device.type == "cpu" and aoti_runner.releases_the_gil():
        try:
            runner = aoti_runner.load(path, tensors)
        except Exception as exc:  # noqa: BLE001 -- torch's loader is the fallback, and says what is wrong
            logger.warning("the GIL-free runner could not load %s (%s: %s); torch's loader runs it, holding the GIL",
                           path, type(exc).__name__, exc)
            runner = None
        if runner is not None:
            return runner
    with _unpacked_in_a_directory_we_remove():
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    # user_managed: the graph reads the model's tensors in place (no copy); a missing name raises.
    loader.load_constants({name: tensors[name] for name in loader.get_constant_fqns()}, False, True, True)
    return loader


def _model_tensors(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by the names the package gives them (`_FlatDecodeStep`
    holds the model as `model`)."""
    tensors: dict[str, torch.Tensor] = {f"model.{name}": p for name, p in model.named_parameters()}
    tensors.update({f"model.{name}": b for name, b in model.named_buffers()})
    return tensors


def _bind(loader: Any, packed: list[torch.Tensor | None], linears: list[LinearLoRA]) -> DecodeStep:
    def step(hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
             meta: DecodeMetadata) -> torch.Tensor:
        flat = [hidden, positions, *(t for pair in kv_caches for t in pair), meta.slot_mapping, meta.block_table,
                meta.seq_lens, *packed, *(graph_inputs(linears) if linears else ())]
        out: torch.Tensor = loader.run(flat)[0]
        return out

    return step


def _bind_graphed(loader: Any, packed: list[torch.Tensor | None], linears: list[LinearLoRA]) -> GraphedStep:
    def step(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = loader.run([hidden, positions, *packed, *(graph_inputs(linears) if linears else ())])[0]
        return out

    return step


def _bind_head(loader: Any) -> HeadStep:
    def step(hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = loader.run([hidden])[0]
        return out

    return step
