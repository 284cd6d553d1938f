"""Engine processes as `trio-llm serve` runs them: spawned (or adopted, when started early),
sent their `EngineInit`, handshaken, and each run as a `CoreClient` over its socket; with data
parallelism, N of them behind one `DataParallelCores`. `engine.api.open_engine_process` builds its
`AsyncEngine` on them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial

import anyio
from anyio.abc import Process

from engine.config import EngineConfig
from engine.core.core_client import CoreClient, handshake
from engine.core.data_parallel import (
    DataParallelCores,
    data_parallel_configs,
    run_data_parallel_rank,
    shared_cpus_warning,
)
from engine.core.engine_core import CoreHandle
from engine.core.engine_messages import EngineInit, EngineReady
from engine.core.engine_spawn import SpawnedEngine, spawn_engine, terminate
from engine.core.stats import StatsObserver
from engine.ipc import wire
from engine.ipc.fast_socket import FastSocketStream
from engine.ipc.process import stop_processes

Started = list[tuple[Process, FastSocketStream]]


@asynccontextmanager
async def started_engine_processes(config: EngineConfig, command: Sequence[str],
                                   spawned: SpawnedEngine | None) -> AsyncGenerator[Started]:
    """One engine process per data-parallel rank of `config` (the first `spawned`, if given), each
    sent its `EngineInit` and loading now. Whatever happens in the block, every one is stopped and
    its socket closed on the way out (shielded, time limited)."""
    warning = shared_cpus_warning(config)
    if warning is not None:
        logging.getLogger("trio_llm.engine").warning(warning)
    started: Started = []
    try:
        for index, engine_config in enumerate(data_parallel_configs(config)):
            spawn = spawned if index == 0 and spawned is not None else await spawn_engine(command)
            stream = FastSocketStream(spawn.socket)
            started.append((spawn.process, stream))
            await wire.send(stream, EngineInit(replace(engine_config, loop_lag_interval=None)))
        yield started
    finally:  # start-up failed or was cancelled, or the engines stopped: nothing is left running
        processes = [process for process, _ in started]
        await stop_processes(processes, partial(_terminate_all, processes))
        with anyio.CancelScope(shield=True):
            for _, stream in started:
                await stream.aclose()


@asynccontextmanager
async def running_cores(config: EngineConfig, started: Started,
                        observer: StatsObserver | None) -> AsyncGenerator[tuple[CoreHandle, EngineReady]]:
    """Wait for each started engine process to be ready (its handshake: a start-up failure it
    reports is raised), then run a `CoreClient` over each; yields the one core the `AsyncEngine`
    drives and the first engine's `EngineReady`. Leaving the block asks every engine to shut down
    (then SIGTERM, then SIGKILL; shielded, time limited) and stops the clients."""
    clients = []
    for process, stream in started:
        reader = wire.FrameReader(stream)
        clients.append(CoreClient(stream, reader, process, await handshake(reader, process), observer))
    async with anyio.create_task_group() as tg:
        core: CoreHandle = clients[0]
        if len(clients) == 1:
            await tg.start(clients[0].run)
        else:
            core = DataParallelCores(clients, config.block_size)
            for rank, client in enumerate(clients):
                await tg.start(run_data_parallel_rank, client, rank, clients)
        try:
            yield core, clients[0].ready
        finally:
            await stop_processes([client.process for client in clients], partial(_shut_down_all, clients))
            tg.cancel_scope.cancel()


def _shut_down_all(clients: Sequence[CoreClient]) -> None:
    for client in clients:
        client.shut_down()


def _terminate_all(processes: Sequence[Process]) -> None:
    for process in processes:
        terminate(process)
