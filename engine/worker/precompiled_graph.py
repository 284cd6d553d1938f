"""The decode graph compiled ahead of time and kept on disk whole, so a warm start loads it
without dynamo tracing the model again (vLLM's `torch_aot_compile` cache, on torch's
`aot_compile` API).

A warm start through `torch.compile` re-traces the model with dynamo and then finds the compiled
code in inductor's caches: ~2.3 s of our warm start. `torch.compile(...).aot_compile` captures the
whole graph once and serialises the compiled function; loading it takes 0.4-0.7 s.

The artefact is saved with no guards (dynamo's guards do not all serialise, and the ones that do
would be re-checked each step). What they would have checked goes into the file's name instead
(`artefact_path`): torch and Python, the model's configuration, parameter shapes and dtypes, the
rotary tables, the KV cache's shape, the block size, the compute threads (inductor's C++ loops
are specialised on them), the vector ISA, and the source of the modeling code. A stale artefact
the key misses is caught at load: `DecodeGraphs` compares one step against the eager model and
compiles again on a mismatch.

Only a model that traces into one graph (no graph break) is saved so; MoE models, whose experts
run eagerly between graphs, keep `torch.compile`.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.models
from engine.models.attention import DecodeMetadata
from engine.models.decoder import DecoderForCausalLM, KVCache

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what is saved, or how it is called, changes
DecodeStep = Callable[[torch.Tensor, torch.Tensor, list[KVCache], DecodeMetadata], torch.Tensor]


def artefact_path(cache_dir: Path, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                  trace_rows: int) -> Path:
    """Where the decode graph of `model` over caches shaped as `kv_caches` is kept: its name is a
    digest of everything the compiled code depends on (see the module doc)."""
    from torch._inductor import config as inductor_config

    assert model.rope is not None, "setup_rope() before compiling"
    parts = (
        FORMAT, torch.__version__, sys.version, torch.get_num_threads(), inductor_config.cpp.vec_isa_ok,
        repr(model.config), str(model.dtype), block_size, trace_rows,
        [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()],
        [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()],
        tuple(model.rope.cos.shape), [(tuple(k.shape), str(k.dtype), str(k.device)) for k, _ in kv_caches],
        _modeling_source_digest(),
    )
    return cache_dir / "decode-graphs" / f"{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}.bin"


def _modeling_source_digest() -> str:
    digest = hashlib.sha256()
    for module_dir in engine.models.__path__:
        for source in sorted(Path(module_dir).glob("*.py")):
            digest.update(source.name.encode())
            digest.update(source.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def load(path: Path, model: DecoderForCausalLM) -> DecodeStep | None:
    """The decode step saved at `path`, or None when there is none or it cannot be read (why is
    logged; the caller compiles again and overwrites it)."""
    if not path.exists():
        return None
    try:
        with path.open("rb") as file:
            compiled = torch.compiler.load_compiled_function(file)
    except Exception as exc:  # any unreadable artefact: torch's format is experimental
        logger.warning("could not load the compiled decode graph %s (%s: %s); compiling it again",
                       path, type(exc).__name__, exc)
        return None
    return _bind(compiled, model)


def compile_and_save(path: Path | None, model: DecoderForCausalLM, example: tuple[Any, ...]) -> DecodeStep:
    """Compile the decode step of `model` on `example` (hidden, positions, kv_caches, meta: their
    dynamic dimensions marked) into one graph, save it at `path` (atomically; None: not saved)
    and return it."""
    compiler: Any = torch.compile(type(model).forward, fullgraph=True, dynamic=False,
                                  options={"guard_filter_fn": _no_guards})
    compiled = compiler.aot_compile(((model, *example), {}))
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
    except Exception as exc:  # a full disk, or something torch cannot serialise: next start compiles again
        logger.warning("could not save the compiled decode graph to %s (%s: %s)", path, type(exc).__name__, exc)
    return _bind(compiled, model)


def _no_guards(entries: list[Any]) -> list[bool]:
    return [False] * len(entries)


def _bind(compiled: Any, model: DecoderForCausalLM) -> DecodeStep:
    compiled.disable_guard_check()  # none were kept: the file's name stands for them

    def step(hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
             meta: DecodeMetadata) -> torch.Tensor:
        out: torch.Tensor = compiled(model, hidden, positions, kv_caches, meta)
        return out

    return step
