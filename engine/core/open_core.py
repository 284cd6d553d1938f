"""Opening the engine core: load the model, size the KV cache, build the scheduler, start the core
task (and the EPLB and EC connector tasks). `engine.api.open_engine` builds its `AsyncEngine` on it,
and the engine process (`engine.core.engine_main`) serves it over a socket.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from engine.core.background_compile import compile_in_background
from engine.core.engine_core import EngineCore
from engine.core.eplb_driver import EplbDriver
from engine.core.stats import StatsObserver
from engine.ec.connector import ECConnectorGate, Loader, SharedStorageConnector
from engine.errors import ModelLoadError
from engine.executor import Executor, create_executor
from engine.hub import resolve_model_files
from engine.kv_groups import sequence_blocks
from engine.model_info import ModelInfo
from engine.models.hf_config import read_generation_defaults
from engine.models.moe import check_expert_options
from engine.render.chat import resolve_chat_template
from engine.render.pooling_tasks import served_pooling_tasks
from engine.render.tokenizer import Tokenizer
from engine.sched.block_manager import KVBlockManager
from engine.sched.prefix_hash import PrefixHasher
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.worker.compile_child import CompileJob


async def _size_engine(config: EngineConfig, executor: Executor, tokenizer: Tokenizer) -> ModelInfo:
    model_info = await executor.load_model()
    max_model_len = config.max_model_len or model_info.max_position_embeddings
    if max_model_len > model_info.max_position_embeddings:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_info.max_position_embeddings})")
    if not config.enable_chunked_prefill and config.token_budget < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({config.token_budget}) must be at "
                         f"least max_model_len ({max_model_len}), or long prompts could never be scheduled")
    budget = await _kv_cache_bytes(config, executor) if config.num_kv_blocks is None else 0
    num_blocks = config.num_kv_blocks or budget // model_info.kv_bytes_per_block
    needed = sequence_blocks(model_info.kv_group_windows, max_model_len, config.block_size, config.token_budget)
    if num_blocks < needed and config.num_kv_blocks is None:
        raise ModelLoadError(
            f"the KV cache budget ({budget} bytes) holds {num_blocks} blocks of {config.block_size} tokens, fewer "
            f"than one sequence of max_model_len ({max_model_len}) needs ({needed}); raise {_budget_flag(config)} "
            f"or lower max_model_len")
    served_pooling_tasks(config, model_info)  # a --runner or --pooler-config task the model cannot serve
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + model_info.eos_token_ids))
    return replace(model_info, num_kv_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids=eos)


async def _kv_cache_bytes(config: EngineConfig, executor: Executor) -> int:
    """Each rank's KV cache bytes: as given; on CUDA, the least any rank's profile run leaves
    within --gpu-memory-utilization (vLLM's rule: every rank holds as many blocks); else 1 GiB."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if not config.measures_kv_cache:
        return DEFAULT_KV_CACHE_BYTES
    budgets = await executor.collective_rpc("kv_cache_bytes_for", (config.gpu_memory_utilization,))
    return int(min(budgets))


def _budget_flag(config: EngineConfig) -> str:
    return "--gpu-memory-utilization" if config.measures_kv_cache else "--kv-cache-memory-bytes"


def build_scheduler(config: EngineConfig, info: ModelInfo, connector: SharedStorageConnector | None = None,
                    ec_blocking: bool = False, streams_bursts: bool = False) -> Scheduler:
    """`streams_bursts`: the executor's (`Executor.streams_bursts`), which decides the default length
    of decode bursts (`EngineConfig.scheduler_steps`)."""
    # As vLLM sizes them: the encoder may compute, and its cache hold, a step's worth of tokens in
    # image rows, and always at least one image.
    encoder_rows = max(config.token_budget, info.image_rows) if info.image_rows else 0
    sched_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.token_budget,
        max_model_len=info.max_model_len, policy=config.scheduling_policy,
        enable_chunked_prefill=config.enable_chunked_prefill, encoder_budget_rows=encoder_rows,
        encoder_cache_rows=encoder_rows, max_loras=config.max_loras if config.enable_lora else 0,
        micro_batches=config.pipeline_parallel_size, async_scheduling=config.schedules_async,
        num_scheduler_steps=config.scheduler_steps(streams_bursts))
    # Blocks are namespaced by the model: a cache never serves KV computed by another model or dtype.
    namespace = f"{config.model}\0{info.architecture}\0{info.dtype}".encode()
    hasher = PrefixHasher(config.prefix_caching_hash_algo, namespace)
    blocks = KVBlockManager(info.num_kv_blocks, config.block_size, config.enable_prefix_caching, hasher,
                            info.kv_group_windows)
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
    config: EngineConfig  # the config served: hub ids resolved to local directories (engine/hub.py)


@asynccontextmanager
async def open_core(config: EngineConfig, *, executor: Executor | None = None, tokenizer: Tokenizer | None = None,
                    observer: StatsObserver | None = None, ec_loader: Loader | None = None,
                    ec_blocking: bool = False) -> AsyncGenerator[LoadedCore]:
    """The engine core without its front end: load the model, size the KV cache, start the core
    task (and the EPLB and EC connector tasks). `open_engine` builds on it, and so does the engine
    process (`engine.core.engine_main`). Leaving the block, or cancelling the task inside it,
    cancels the core task; requests still open end with `EngineDeadError`; worker processes are
    stopped (shielded, time limited). A failing core task raises out of the block. A hub id is
    resolved first (a download, if the hub cache lacks it: cancellation waits for the file being
    fetched)."""
    config = await anyio.to_thread.run_sync(resolve_model_files, config)
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
        job = await _background_compile_job(config, executor)
        eplb = EplbDriver(config.eplb_config, executor, info, observer) if config.enable_eplb else None
        connector = None
        if config.ec_transfer_config is not None and info.image_rows:
            connector = SharedStorageConnector(config.ec_transfer_config, config.ec_defer_timeout, wake=lambda: None,
                                               loader=ec_loader)
        scheduler = build_scheduler(config, info, connector, ec_blocking, streams_bursts=executor.streams_bursts)
        core = EngineCore(scheduler, executor, tokenizer, observer, eplb)
        async with anyio.create_task_group() as tg:
            if eplb is not None:
                await tg.start(eplb.run)
            if connector is not None:
                connector.wake = core.wake
                await tg.start(connector.run)
            await tg.start(core.run)
            if job is not None:
                tg.start_soon(compile_in_background, job, executor, core.graphs_settled)
            else:
                core.graphs_settled.set()
            tg.start_soon(_stop_core_on_executor_failure, executor, core)
            try:
                yield LoadedCore(core, info, tokenizer, defaults, tg, config)
            finally:
                tg.cancel_scope.cancel()


async def _background_compile_job(config: EngineConfig, executor: Executor) -> CompileJob | None:
    """The graphs the worker left to a child process (`compile_in_background`), if any."""
    if not config.compile_in_background:
        return None
    job: CompileJob | None = await executor.collective_rpc("background_compile_job", unique_reply_rank=0)
    return job


async def _stop_core_on_executor_failure(executor: Executor, core: EngineCore) -> None:
    """A worker that dies while the engine is idle stops it at once (not at the next request),
    so health checks fail and every open request gets the error naming the worker.

    Runs until cancelled with the engine."""
    core.executor_failed(await executor.wait_for_failure())
