"""Opening an engine: load the model, size the KV cache, start the engine-core task.

    async with open_engine(EngineConfig(model="path/to/model")) as engine:
        ...
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import anyio

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
    await anyio.to_thread.run_sync(check_expert_options, config)  # before any worker starts
    executor = executor or create_executor(config)
    async with executor:  # worker processes start here (multi-process executor) and stop on the way out
        if tokenizer is None:
            tokenizer = await anyio.to_thread.run_sync(Tokenizer, config.tokenizer_path)
        if config.chat_template is not None:
            tokenizer.chat_template = await anyio.to_thread.run_sync(resolve_chat_template, config.chat_template)
        info = await _size_engine(config, executor, tokenizer)
        defaults = await anyio.to_thread.run_sync(read_generation_defaults, config.generation_config, config.model)
        image_spec = await anyio.to_thread.run_sync(_image_spec, config, info, tokenizer)
        await executor.initialize_kv_cache(info.num_kv_blocks)
        eplb = EplbDriver(config.eplb_config, executor, info, observer) if config.enable_eplb else None
        connector = None
        if config.ec_transfer_config is not None and info.image_rows:
            connector = SharedStorageConnector(config.ec_transfer_config, config.ec_defer_timeout, wake=lambda: None,
                                               loader=ec_loader)
        core = EngineCore(build_scheduler(config, info, connector, ec_blocking), executor, tokenizer, observer, eplb)
        loop_lag = LoopLagReadings()
        async with anyio.create_task_group() as tg:
            if eplb is not None:
                await tg.start(eplb.run)
            if connector is not None:
                connector.wake = core.wake
                await tg.start(connector.run)
            await tg.start(core.run)
            tg.start_soon(_stop_core_on_executor_failure, executor, core)
            if config.loop_lag_interval is not None:
                on_lag = (observer or NullObserver()).on_loop_lag

                def observe_lag(lag: float) -> None:
                    loop_lag.record(lag)
                    on_lag(lag)

                await tg.start(run_loop_lag_probe, observe_lag, config.loop_lag_interval)
            try:
                yield AsyncEngine(config, info, tokenizer, core, loop_lag, sampling_defaults=defaults,
                                  image_spec=image_spec)
            finally:
                tg.cancel_scope.cancel()


def _image_spec(config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer) -> ImageSpec | None:
    """What the renderer needs for a vision-language model's images (None for other models)."""
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
