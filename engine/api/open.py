"""Opening an engine: load the model, size the KV cache, start the engine-core task.

    async with open_engine(EngineConfig(model="path/to/model")) as engine:
        ...
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.api.async_engine import AsyncEngine
from engine.concurrency.loop_lag import run_loop_lag_probe
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.eplb_driver import EplbDriver
from engine.core.stats import LoopLagReadings, NullObserver, StatsObserver
from engine.ec.connector import ECConnectorGate, Loader, SharedStorageConnector
from engine.errors import ModelLoadError
from engine.executor import Executor, create_executor
from engine.model_info import ModelInfo
from engine.models.hf_config import read_generation_defaults
from engine.models.moe import check_expert_options
from engine.render.image import ImageProcessorConfig
from engine.render.multimodal import ImageSpec
from engine.render.tokenizer import Tokenizer
from engine.sched.block_manager import KVBlockManager
from engine.sched.prefix_hash import PrefixHasher
from engine.sched.scheduler import Scheduler, SchedulerConfig


async def _size_engine(config: EngineConfig, executor: Executor, tokenizer: Tokenizer) -> ModelInfo:
    model_info = await executor.load_model()
    max_model_len = config.max_model_len or model_info.max_position_embeddings
    if max_model_len > model_info.max_position_embeddings:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_info.max_position_embeddings})")
    if not config.enable_chunked_prefill and config.token_budget < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({config.token_budget}) must be at "
                         f"least max_model_len ({max_model_len}), or long prompts could never be scheduled")
    num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // model_info.kv_bytes_per_block
    if num_blocks * config.block_size < max_model_len and config.num_kv_blocks is None:
        raise ModelLoadError(
            f"the KV cache budget ({config.kv_cache_memory_bytes} bytes) holds {num_blocks * config.block_size} "
            f"tokens, fewer than max_model_len ({max_model_len}); raise kv_cache_memory_bytes or lower max_model_len")
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + model_info.eos_token_ids))
    return replace(model_info, num_kv_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids=eos)


def build_scheduler(config: EngineConfig, info: ModelInfo, connector: SharedStorageConnector | None = None,
                    ec_blocking: bool = False) -> Scheduler:
    # As vLLM sizes them: the encoder may compute, and its cache hold, a step's worth of tokens in
    # image rows, and always at least one image.
    encoder_rows = max(config.token_budget, info.image_rows) if info.image_rows else 0
    sched_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.token_budget,
        max_model_len=info.max_model_len, policy=config.scheduling_policy,
        enable_chunked_prefill=config.enable_chunked_prefill, encoder_budget_rows=encoder_rows,
        encoder_cache_rows=encoder_rows)
    # Blocks are namespaced by the model: a cache never serves KV computed by another model or dtype.
    namespace = f"{config.model}\0{info.architecture}\0{info.dtype}".encode()
    hasher = PrefixHasher(config.prefix_caching_hash_algo, namespace)
    blocks = KVBlockManager(info.num_kv_blocks, config.block_size, config.enable_prefix_caching, hasher)
    if connector is None or not connector.consumer:
        return Scheduler(sched_config, blocks)
    scheduler = Scheduler(sched_config, blocks, [ECConnectorGate(connector, ec_blocking)], external=connector)
    connector.has_local = scheduler.encoder_cache.has
    return scheduler


@dataclass(frozen=True)
class LoadedCore:
    """What `open_core` yields: the running core and the facts about the model it serves."""

    core: EngineCore
    info: ModelInfo  # sized: KV blocks, context length, end-of-sequence ids
    tokenizer: Tokenizer
    sampling_defaults: dict[str, Any]  # from generation_config.json
    task_group: TaskGroup  # the core's: tasks started here stop with it (one group, so one level of errors)


@asynccontextmanager
async def open_core(config: EngineConfig, *, executor: Executor | None = None, tokenizer: Tokenizer | None = None,
                    observer: StatsObserver | None = None, ec_loader: Loader | None = None,
                    ec_blocking: bool = False) -> AsyncGenerator[LoadedCore]:
    """The engine core without its front end: load the model, size the KV cache, start the core
    task (and the EPLB and EC connector tasks). `open_engine` builds on it, and so does the engine
    process (`engine.api.engine_main`). Leaving the block, or cancelling the task inside it,
    cancels the core task; requests still open end with `EngineDeadError`; worker processes are
    stopped (shielded, time limited). A failing core task raises out of the block."""
    await anyio.to_thread.run_sync(check_expert_options, config)  # before any worker starts
    executor = executor or create_executor(config)
    async with executor:  # worker processes start here (multi-process executor) and stop on the way out
        if tokenizer is None:
            tokenizer = await anyio.to_thread.run_sync(Tokenizer, config.tokenizer_path)
        if config.chat_template is not None:
            tokenizer.chat_template = await anyio.to_thread.run_sync(resolve_chat_template, config.chat_template)
        info = await _size_engine(config, executor, tokenizer)
        defaults = await anyio.to_thread.run_sync(read_generation_defaults, config.generation_config, config.model)
        await executor.initialize_kv_cache(info.num_kv_blocks)
        eplb = EplbDriver(config.eplb_config, executor, info, observer) if config.enable_eplb else None
        connector = None
        if config.ec_transfer_config is not None and info.image_rows:
            connector = SharedStorageConnector(config.ec_transfer_config, config.ec_defer_timeout, wake=lambda: None,
                                               loader=ec_loader)
        core = EngineCore(build_scheduler(config, info, connector, ec_blocking), executor, tokenizer, observer, eplb)
        async with anyio.create_task_group() as tg:
            if eplb is not None:
                await tg.start(eplb.run)
            if connector is not None:
                connector.wake = core.wake
                await tg.start(connector.run)
            await tg.start(core.run)
            tg.start_soon(_stop_core_on_executor_failure, executor, core)
            try:
                yield LoadedCore(core, info, tokenizer, defaults, tg)
            finally:
                tg.cancel_scope.cancel()


@asynccontextmanager
async def open_engine(config: EngineConfig, *, executor: Executor | None = None,
                      tokenizer: Tokenizer | None = None,
                      observer: StatsObserver | None = None,
                      ec_loader: Loader | None = None, ec_blocking: bool = False) -> AsyncGenerator[AsyncEngine]:
    """Load the model, start the engine-core task, and yield the engine.

    `executor` replaces the default one (tests pass a fake whose steps take
    virtual time under `MockClock`); `observer` receives per-request timings
    and counts for metrics (and loop-lag readings, with
    `config.loop_lag_interval`). Leaving the block, or cancelling the task
    inside it, cancels the core task and the probe; requests still open end
    with `EngineDeadError`, and worker processes are stopped (shielded, time
    limited). Load errors raise `ModelLoadError` naming the problem, with
    nothing left running. `ec_loader` replaces how the EC connector reads a stored encoder output
    (tests pass one that takes virtual time); `ec_blocking` makes a request that waits for its
    images hold up the requests behind it (the baseline `trio-llm bench ec` measures).
    """
    async with open_core(config, executor=executor, tokenizer=tokenizer, observer=observer, ec_loader=ec_loader,
                         ec_blocking=ec_blocking) as loaded:
        image_spec = await anyio.to_thread.run_sync(image_spec_for, config, loaded.info, loaded.tokenizer)
        loop_lag = await start_loop_lag_probe(loaded.task_group, config, observer)
        yield AsyncEngine(config, loaded.info, loaded.tokenizer, loaded.core, loop_lag,
                          sampling_defaults=loaded.sampling_defaults, image_spec=image_spec)


async def start_loop_lag_probe(tg: TaskGroup, config: EngineConfig, observer: StatsObserver | None) -> LoopLagReadings:
    """Start the loop-lag probe in `tg` when `config.loop_lag_interval` asks for one; its readings
    go to the returned record and to `observer.on_loop_lag`. It runs until `tg` is cancelled."""
    loop_lag = LoopLagReadings()
    if config.loop_lag_interval is not None:
        on_lag = (observer or NullObserver()).on_loop_lag

        def observe_lag(lag: float) -> None:
            loop_lag.record(lag)
            on_lag(lag)

        await tg.start(run_loop_lag_probe, observe_lag, config.loop_lag_interval)
    return loop_lag


def image_spec_for(config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer) -> ImageSpec | None:
    """What the renderer needs for a vision-language model's images (None for other models); used
    by both `open_engine` and `open_engine_process`."""
    if info.image_token_id is None:
        return None
    token = tokenizer.id_to_token(info.image_token_id)
    if token is None:
        raise ModelLoadError(f"the tokenizer has no token for the image token id {info.image_token_id}")
    return ImageSpec(ImageProcessorConfig.from_model_dir(config.model), info.image_token_id, token, info.image_rows)


async def _stop_core_on_executor_failure(executor: Executor, core: EngineCore) -> None:
    """A worker that dies while the engine is idle stops it at once (not at the next request),
    so health checks fail and every open request gets the error naming the worker.

    Runs until cancelled with the engine."""
    core.executor_failed(await executor.wait_for_failure())


def resolve_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM reads it)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template long or odd enough not to be a path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ModelLoadError(f"--chat-template {value!r} is neither a file nor a Jinja template")
