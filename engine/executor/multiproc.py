"""The multi-process executor: one spawned child process per tensor-parallel rank.

Each child runs `engine.worker.worker_main` (its own trio program hosting
the same `Worker` class the in-process executor uses) and talks to us over
its end of a socketpair, passed as an inherited file descriptor: no port is
opened. Calls go through `WorkerGroup` (ordered RPC futures).

Lifecycle (use as an async context manager; `open_engine` does):
- start: spawn every child, send each its `Init`, wait for every `Ready`.
  A child that fails to start fails the whole start with its traceback,
  and every child is stopped before the error propagates.
- serving: a task per child waits for it to exit. An unexpected exit fails
  every pending and later call with `EngineDeadError` at once and closes
  every connection, which makes the other children exit too.
- stop (also on cancellation; shielded and time-limited): ask (`Shutdown`),
  wait, SIGTERM, wait, SIGKILL, reap (`engine.ipc.process.stop_processes`). Children also die with the parent
  process (a pidfd watch in the child), so not even a killed parent leaves orphans.
"""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import replace

import anyio
from anyio.abc import Process, TaskGroup

from engine.config import EngineConfig, usable_cpus
from engine.cpu_binding import split_layout
from engine.errors import EngineDeadError
from engine.executor.rpc import WorkerConnection
from engine.executor.worker_group import WorkerGroupExecutor
from engine.ipc.fast_socket import FastSocketStream
from engine.ipc.process import describe_exit, spawn_with_socket, stop_processes
from engine.worker.worker_messages import Init

log = logging.getLogger("trio_llm.executor")


class MultiprocExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig, *, worker_command: list[str] | None = None) -> None:
        super().__init__()
        self.config = config
        self.world_size = config.world_size
        # Tests swap in a command that starts a misbehaving worker.
        self.worker_command = worker_command or [sys.executable, "-m", "engine.worker.worker_main"]
        self.processes: list[Process] = []
        self._init_method: str | None = None  # torch.distributed's rendezvous, chosen once

    # ---- lifecycle (WorkerGroupExecutor.__aenter__) --------------------------------------------
    def _start_watchers(self, task_group: TaskGroup) -> None:
        for rank, process in enumerate(self.processes):
            task_group.start_soon(self._watch, rank, process)

    async def _start_workers(self) -> list[WorkerConnection]:
        connections = [await self._spawn(rank) for rank in range(self.world_size)]
        threads = max(1, usable_cpus() // self.world_size)
        # Bound compute CPUs are split between the ranks, as the unbound ones are by the thread count.
        layouts = split_layout(self.config.cpu_layout, self.world_size)
        inits = [Init(conn.rank, self.world_size, replace(self.config, cpu_layout=layouts[conn.rank]),
                      self._distributed_init_method(), threads, conn.poll)
                 for conn in connections]
        await self._handshake_all(connections, inits)
        for init, process in zip(inits, self.processes, strict=True):
            layout = init.config.cpu_layout
            cpus = layout.describe() if layout is not None else f"not bound, {threads} torch threads"
            log.info("worker rank %d (stage %d): pid %d on this node, %s", init.rank,
                     init.rank // self.config.tensor_parallel_size, process.pid, cpus)
        return connections

    async def _spawn(self, rank: int) -> WorkerConnection:
        process, ours = await spawn_with_socket(self.worker_command)
        self.processes.append(process)
        # Polling sockets pays only while every polling process has a core; past that it steals them.
        poll = self.world_size + 1 <= usable_cpus()
        return WorkerConnection(rank, FastSocketStream(ours), poll=poll)

    def _distributed_init_method(self) -> str | None:
        if self.world_size == 1:
            return None
        if self._init_method is None:
            with socket.socket() as probe:  # a free port for torch.distributed's rendezvous
                probe.bind(("127.0.0.1", 0))
                self._init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        return self._init_method

    async def _describe_early_exit(self, rank: int) -> str:
        return describe_exit(await self.processes[rank].wait())

    async def _watch(self, rank: int, process: Process) -> None:
        await process.wait()
        self._report_exit(rank)

    async def _connection_lost(self, rank: int) -> None:
        """A worker's socket closed: it is probably dying; name how it ended if it does so soon."""
        with anyio.move_on_after(1.0):
            await self.processes[rank].wait()
        self._report_exit(rank)

    def _report_exit(self, rank: int) -> None:
        process = self.processes[rank]
        if process.returncode is not None:
            self._worker_lost(EngineDeadError(
                f"worker rank {rank} (pid {process.pid}) exited unexpectedly ({describe_exit(process.returncode)})"))

    async def _stop_workers(self) -> None:
        """Ask, wait, SIGTERM, wait, SIGKILL, reap. Shielded: runs to the end even when cancelled."""
        self._closing = True
        group = self.group
        ask = group.shutdown if group is not None and group.failure is None else None
        await stop_processes(self.processes, ask)
        if group is not None:
            group.fail(EngineDeadError("the executor was closed"))

    def workers_alive(self) -> tuple[bool, ...]:
        return tuple(process.returncode is None for process in self.processes)

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(process.pid for process in self.processes)
