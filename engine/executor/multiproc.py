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

import math
import socket
import sys
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import anyio
from anyio.abc import Process

from engine.concurrency.gather import gather_first_failure
from engine.concurrency.to_the_end import run_to_the_end
from engine.config import EngineConfig, usable_cpus
from engine.errors import EngineDeadError, ModelLoadError
from engine.executor.base import Executor
from engine.executor.rpc import WorkerConnection, WorkerError, WorkerGroup
from engine.ipc import wire
from engine.ipc.fast_socket import STREAM_ENDED, FastSocketStream
from engine.ipc.process import describe_exit, spawn_with_socket, stop_processes
from engine.model_info import ModelInfo
from engine.models.hf_config import read_config_json
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.messages import Init, Ready, StartupFailed

STARTUP_TIMEOUT = 300.0  # importing torch and joining the process group


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, *, worker_command: list[str] | None = None) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        # Tests swap in a command that starts a misbehaving worker.
        self.worker_command = worker_command or [sys.executable, "-m", "engine.worker.worker_main"]
        self.processes: list[Process] = []
        self.group: WorkerGroup | None = None
        self._closing = False
        self._a_worker_exited = anyio.Event()
        self._failed = anyio.Event()
        self._failure: BaseException | None = None
        self._init_method: str | None = None  # torch.distributed's rendezvous, chosen once
        self._stack: AsyncExitStack | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> MultiprocExecutor:
        check_tensor_parallel(self.config)  # before any worker starts: a wrong size fails at once
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            stack.push_async_callback(self._stop_workers)  # if start-up fails half way
            connections = await self._start_workers()
            task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._stop_workers)  # on the way out: before the task group ends
            self.group = WorkerGroup(connections, self._connection_lost)
            await task_group.start(self.group.run)
            for rank, process in enumerate(self.processes):
                task_group.start_soon(self._watch, rank, process)
        except BaseException:
            if not await stack.__aexit__(*sys.exc_info()):
                raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack = self._stack, None
        return await stack.__aexit__(*exc_info) if stack else None

    async def aclose(self) -> None:
        await self._stop_workers()

    async def _start_workers(self) -> list[WorkerConnection]:
        connections = [await self._spawn(rank) for rank in range(self.world_size)]
        try:
            await self._handshake_all(connections)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for conn in connections:
                    await conn.stream.aclose()
            raise
        return connections

    async def _spawn(self, rank: int) -> WorkerConnection:
        process, ours = await spawn_with_socket(self.worker_command)
        self.processes.append(process)
        stream = FastSocketStream(ours)
        threads = max(1, usable_cpus() // self.world_size)
        # Polling sockets pays only while every polling process has a core; past that it steals them.
        poll = self.world_size + 1 <= usable_cpus()
        init = Init(rank, self.world_size, self.config, self._distributed_init_method(), threads, poll)
        await wire.send(stream, init)
        return WorkerConnection(rank, stream, poll=poll)

    def _distributed_init_method(self) -> str | None:
        if self.world_size == 1:
            return None
        if self._init_method is None:
            with socket.socket() as probe:  # a free port for torch.distributed's rendezvous
                probe.bind(("127.0.0.1", 0))
                self._init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        return self._init_method

    async def _handshake_all(self, connections: list[WorkerConnection]) -> None:
        """Wait for every `Ready` at once: ranks wait for each other while joining the process
        group, so the first failure must stop the wait on the others."""
        with anyio.fail_after(STARTUP_TIMEOUT):
            await gather_first_failure([partial(self._handshake, conn) for conn in connections])

    async def _handshake(self, conn: WorkerConnection) -> None:
        try:
            message = await conn.reader.receive()
        except STREAM_ENDED:  # it exited (perhaps before reading its Init)
            code = await self.processes[conn.rank].wait()
            raise ModelLoadError(f"worker rank {conn.rank} exited during start-up ({describe_exit(code)})") from None
        if isinstance(message, StartupFailed):
            raise ModelLoadError(f"worker rank {conn.rank} failed to start:\n{message.error}")
        if not isinstance(message, Ready):
            raise ModelLoadError(f"worker rank {conn.rank} sent {type(message).__name__} instead of Ready")

    async def _watch(self, rank: int, process: Process) -> None:
        await process.wait()
        self._a_worker_exited.set()
        self._report_exit(rank)

    async def _connection_lost(self, rank: int) -> None:
        """A worker's socket closed: it is probably dying; name how it ended if it does so soon."""
        with anyio.move_on_after(1.0):
            await self.processes[rank].wait()
        self._report_exit(rank)

    def _report_exit(self, rank: int) -> None:
        process = self.processes[rank]
        if process.returncode is not None and not self._closing and self.group is not None:
            error = EngineDeadError(
                f"worker rank {rank} (pid {process.pid}) exited unexpectedly ({describe_exit(process.returncode)})")
            self.group.fail(error)
            if self._failure is None:
                self._failure = error
                self._failed.set()

    async def wait_for_failure(self) -> BaseException:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    async def _stop_workers(self) -> None:
        """Ask, wait, SIGTERM, wait, SIGKILL, reap. Shielded: runs to the end even when cancelled."""
        self._closing = True
        group = self.group
        ask = group.shutdown if group is not None and group.failure is None else None
        await stop_processes(self.processes, ask)
        if group is not None:
            group.fail(EngineDeadError("the executor was closed"))

    # ---- the executor interface ----------------------------------------------------------------
    def _workers(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("the executor is not started: use it as an async context manager")
        return self.group

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *,
                             timeout: float | None = None,  # noqa: ASYNC109 -- vLLM's collective_rpc signature
                             non_block: bool = False,
                             unique_reply_rank: int | None = None) -> Any:
        # Documented on Executor.collective_rpc; the group does the work.
        return await self._workers().collective_rpc(method, args, kwargs, timeout=timeout, non_block=non_block,
                                                    unique_reply_rank=unique_reply_rank)

    def workers_alive(self) -> tuple[bool, ...]:
        return tuple(process.returncode is None for process in self.processes)

    async def load_model(self) -> ModelInfo:
        info: ModelInfo = await self.collective_rpc("load_model", unique_reply_rank=0)
        return info

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        await self.collective_rpc("initialize_kv_cache", (num_blocks,))

    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank runs the step; only rank 0 samples and replies. Cancellation waits for that
        reply (the executor's contract), then raises; a worker that dies meanwhile fails the call."""
        try:
            output: ModelRunnerOutput = await run_to_the_end(
                partial(self.collective_rpc, "execute_model", (sched_out,), unique_reply_rank=0))
            return output
        except WorkerError as exc:
            raise await self._root_cause(exc) from exc

    async def _root_cause(self, error: WorkerError) -> BaseException:
        """Under tensor parallelism a rank's death shows first as its peers' collective errors
        ("connection reset by peer"): wait a moment for a watcher to name the real cause."""
        if self.world_size > 1:
            with anyio.move_on_after(1.0):
                await self._a_worker_exited.wait()  # set together with the exit's report
        return self.group.failure if self.group is not None and self.group.failure is not None else error


def check_tensor_parallel(config: EngineConfig) -> None:
    """`ModelLoadError` if the model's heads do not split evenly over the ranks, naming sizes that work."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    raw = read_config_json(config.model)
    heads = raw.get("num_attention_heads")
    if not isinstance(heads, int):
        return  # not a decoder config: the worker reports what it cannot split
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % size or kv_heads % size:
        common = math.gcd(heads, kv_heads)
        sizes = [n for n in range(1, common + 1) if common % n == 0]
        raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads "
                             f"and {kv_heads} key/value heads; sizes that do: {', '.join(map(str, sizes))}")


