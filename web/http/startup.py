"""What `trio-llm serve` says when it starts, and when it cannot.

Failures before serving are one or two lines naming the cause and what to do,
not tracebacks (`--log-level debug` adds the traceback).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import EngineDeadError, ModelLoadError

if TYPE_CHECKING:  # the CLI imports this module before torch (web/cli.py)
    from engine.api import AsyncEngine
    from engine.model_info import ModelInfo

logger = logging.getLogger("trio_llm.serve")


def trio_llm_version() -> str:
    try:
        return version("trio-llm")
    except PackageNotFoundError:
        return "unknown"


def describe_engine(engine: AsyncEngine, config: EngineConfig, load_seconds: float,
                    engine_pids: Sequence[int] = ()) -> list[str]:
    """The lines users look for once the engine is up (`engine_pids`: the engine processes', when
    the engine core runs apart from the server; one per data-parallel engine)."""
    from engine.api import data_parallel_configs  # the engine is up: torch is loaded anyway
    info = engine.info
    stages, ranks = config.pipeline_parallel_size, config.tensor_parallel_size
    layout = (f"{config.world_size} worker processes ({stages} pipeline stages of {ranks})" if stages > 1
              else f"{ranks} worker processes (tensor parallel)" if ranks > 1
              else "a worker process" if config.executor_kind != "inproc" else "in-process (a worker thread)")
    if config.executor_kind == "ray":
        layout += ", Ray actors"
    core = ("in the server process" if not engine_pids
            else f"its own process (pid {engine_pids[0]})" if len(engine_pids) == 1
            else f"{len(engine_pids)} engine processes, data parallel (pids {', '.join(map(str, engine_pids))})")
    cache_dtype = f", {info.kv_cache_dtype}" if info.kv_cache_dtype else ""  # an encoder has no KV cache dtype
    return [f"trio-llm {trio_llm_version()}",
            f"model {config.model} ({info.architecture or info.kind}), dtype {info.dtype}, "
            f"context {info.max_model_len} tokens",
            f"weights: {info.weight_bytes / 2**20:.1f} MiB per rank, " +
            _quantization_line(info),
            f"engine core: {core}; executor: {layout}, device {config.device}; {_steps_line(config)}",
            "CPUs: " + ("; ".join(f"engine {rank}: {_cpus_line(part)}"
                                  for rank, part in enumerate(data_parallel_configs(config)))
                        if config.data_parallel_size > 1 else _cpus_line(config)),
            f"KV cache: {info.num_kv_blocks} blocks of {config.block_size} tokens "
            f"({info.num_kv_blocks * config.block_size} tokens{cache_dtype})",
            f"engine ready in {load_seconds:.1f} s"] + (
        [f"sampling defaults from generation_config.json (a request's own values win): {engine.sampling_defaults}"]
        if engine.sampling_defaults else [])


def check_port_free(host: str, port: int) -> None:
    """Raise the OSError a listener on (host, port) would meet now (EADDRINUSE, ...)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
        probe.bind((host, port))


def _causes(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _causes(inner)]
    return [exc]


def engine_death(exc: BaseException) -> str | None:
    """One line for an engine that died while serving (its process or a worker process exited):
    the `EngineDeadError` that names how; None for anything else (a bug: show the traceback)."""
    for cause in _causes(exc):
        if isinstance(cause, EngineDeadError):
            return str(cause)
    return None


def explain(exc: BaseException) -> str | None:
    """One line for a failure users can fix; None for anything else (a bug: show the traceback)."""
    for cause in _causes(exc):
        if isinstance(cause, ModelLoadError):
            return f"cannot load the model: {cause}"
        if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
            return f"the address is in use ({cause.strerror}): choose another --port, or stop what listens there"
        if isinstance(cause, ValueError):
            return f"invalid configuration: {cause}"
    return None


def startup_failure(exc: BaseException, *, debug: bool = False, command: str = "serve") -> int:
    """Report a failure of `trio-llm COMMAND` (serve, or generate) and return the exit status (never 0)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    line = explain(exc)
    if line is None or debug:
        traceback.print_exception(exc, file=sys.stderr)
    if line is not None:
        print(f"trio-llm {command}: {line}", file=sys.stderr)
    return 1


def _steps_line(config: EngineConfig) -> str:
    """How the core runs steps: one ahead (async scheduling), in decode bursts, or one at a time.
    The worker thread of an in-process executor streams a burst's tokens (`Executor.streams_bursts`)."""
    if config.schedules_async:
        return "each step scheduled while the one before it runs (--async-scheduling)"
    streams = config.executor_kind == "inproc"  # the worker a thread of the engine's process
    steps = config.scheduler_steps(streams_bursts=streams)
    if steps > 1:
        streamed = "each token streamed as it is sampled" if streams else "tokens sent a burst at a time"
        return (f"decode bursts of up to {steps} steps while every request decodes and none waits, "
                f"{streamed} (--num-scheduler-steps)")
    return "one step at a time"


def _cpus_line(config: EngineConfig) -> str:
    layout = config.cpu_layout
    threads = len(layout.compute) if layout is not None else _default_threads()
    where = layout.describe() if layout is not None else "not bound (--cpu-threads-bind none)"
    source = "one per compute CPU" if layout is not None else "torch's default"
    if config.tunes_cpu_threads and layout is not None and layout.borrow:
        return (f"{where}; each step 1-{layout.most_threads} compute threads, whichever steps fastest, "
                f"the last on CPUs {','.join(map(str, layout.borrow))} of the event loop's, lent while "
                "that is faster (--adaptive-cpu-threads); the HTTP server unbound, on whichever CPU is idle")
    if threads > 1 and config.tunes_cpu_threads:
        return f"{where}; each step 1-{threads} compute threads, whichever steps fastest (--adaptive-cpu-threads)"
    return f"{where}, {threads} compute threads ({source})"


def _default_threads() -> int:
    """torch's intra-op threads in a process that binds nothing (the engine process's too: same
    machine, same environment). torch is loaded by now: the engine is up."""
    import torch
    return torch.get_num_threads()


def _quantization_line(info: ModelInfo) -> str:
    """How the linear layers are held, and (--q8-0-activations) how a batch of decodes' rows meet
    the q8_0 ones where not as float32: an arithmetic that changes the results says so."""
    if not info.quantization:
        return "not quantized"
    if info.q8_0_activations == "int8":
        return (f"linear layers {info.quantization}; the q8_0 ones round a batch of decodes' rows to int8 per "
                "block (--q8-0-activations int8)")
    if info.q8_0_activations == "auto":
        return (f"linear layers {info.quantization} weight-only; decodes meet q8_0 layers as two int8 levels a "
                "row, ~16 bits a value, on tiles laid out for them (a second copy of those weights; "
                "--q8-0-activations auto; float32 keeps float rows and no copy)")
    return f"linear layers {info.quantization} weight-only"
