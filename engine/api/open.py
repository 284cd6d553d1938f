"""Opening an engine: the `AsyncEngine` over an engine core in this process (`open_engine`) or in a
process of its own (`open_engine_process`, as `trio-llm serve` runs it).

    async with open_engine(EngineConfig(model="path/to/model")) as engine:
        ...
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup

from engine.api.async_engine import AsyncEngine
from engine.concurrency.loop_lag import run_loop_lag_probe
from engine.config import EngineConfig
from engine.core.engine_processes import running_cores, started_engine_processes
from engine.core.engine_spawn import ENGINE_COMMAND, SpawnedEngine
from engine.core.open_core import open_core
from engine.core.stats import LoopLagReadings, NullObserver, StatsObserver
from engine.ec.connector import Loader
from engine.errors import ModelLoadError
from engine.executor import Executor
from engine.hub import resolve_model_files
from engine.model_info import ModelInfo
from engine.render.chat import resolve_chat_template
from engine.render.image import ImageProcessorConfig
from engine.render.prompt_images import ImageSpec
from engine.render.tokenizer import Tokenizer


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
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 runs an engine process per rank: use open_engine_process "
                         "(as `trio-llm serve` does)")
    async with open_core(config, executor=executor, tokenizer=tokenizer, observer=observer, ec_loader=ec_loader,
                         ec_blocking=ec_blocking) as loaded:
        config = loaded.config
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


@asynccontextmanager
async def open_engine_process(config: EngineConfig, *, observer: StatsObserver | None = None,
                              command: Sequence[str] = ENGINE_COMMAND,
                              spawned: SpawnedEngine | None = None) -> AsyncGenerator[AsyncEngine]:
    """Start the engine core in a process of its own and yield an `AsyncEngine` over it; with
    `config.data_parallel_size` N > 1, N engine processes behind the one `AsyncEngine`
    (engine/core/data_parallel.py), loading at once, the compute CPUs split between them.

    `spawned`: an engine process already started (`engine_process_started`), which this adopts
    (and stops, as one it started) instead of starting one; `command` is then unused.

    `observer` receives the engine processes' metrics (and this process's loop-lag readings, with
    `config.loop_lag_interval`). Start-up failures raise what `open_engine` would
    (`ModelLoadError` naming the problem), with every process stopped. Leaving the block, or
    cancelling the task inside it, stops the engine processes (asked, then SIGTERM, then SIGKILL;
    shielded and time limited); requests still open end with `EngineDeadError`. If the engine
    process dies or its core fails, the failure is raised out of the block; under data
    parallelism, only once every engine has (until then the others serve on).
    """
    config = await anyio.to_thread.run_sync(resolve_model_files, config)  # once, before the processes start
    async with started_engine_processes(config, command, spawned) as started:
        # Loaded here while the engine processes import torch and load the model.
        tokenizer = await anyio.to_thread.run_sync(Tokenizer, config.tokenizer_path)
        async with running_cores(config, started, observer) as (core, ready), anyio.create_task_group() as tg:
            image_spec = await anyio.to_thread.run_sync(image_spec_for, config, ready.info, tokenizer)
            if config.chat_template is not None:
                tokenizer.chat_template = await anyio.to_thread.run_sync(resolve_chat_template, config.chat_template)
            loop_lag = await start_loop_lag_probe(tg, config, observer)
            try:
                yield AsyncEngine(config, ready.info, tokenizer, core, loop_lag,
                                  sampling_defaults=ready.sampling_defaults, image_spec=image_spec)
            finally:
                tg.cancel_scope.cancel()
