"""What every executor of worker processes shares, wherever the processes run.

`MultiprocExecutor` spawns its workers as children of this process; `RayExecutor`
places them as Ray actors, on this node or others. Either way each worker ends up
as a byte stream carrying the same frames (`engine.worker.worker_messages`), and the
rest is here: the start-up handshake (`Init` out, `Ready` or `StartupFailed`
back, every rank at once), the ordered RPC group over the streams
(`engine.executor.rpc.WorkerGroup`), the executor calls the engine core makes,
and failing the engine once, with the first cause, when a worker is lost.
"""

from __future__ import annotations

import math
import sys
from abc import abstractmethod
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup

from engine.concurrency.gather import gather_first_failure
from engine.config import EngineConfig
from engine.errors import EngineDeadError, ModelLoadError
from engine.executor.base import Executor, PendingStep
from engine.executor.rpc import WorkerConnection, WorkerError, WorkerGroup
from engine.ipc import wire
from engine.ipc.fast_socket import STREAM_ENDED
from engine.model_info import ModelInfo
from engine.models.hf_config import read_config_json
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker_messages import Init, Ready, RPCMethod, StartupFailed

STARTUP_TIMEOUT = 300.0  # importing torch and joining the process group


class WorkerGroupExecutor(Executor):
    """An executor whose workers answer over `WorkerGroup` (subclasses start and stop them).
    Ranks are numbered stage by stage (engine/models/parallel.py)."""

    config: EngineConfig
    world_size: int

    def __init__(self) -> None:
        self.group: WorkerGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._closing = False
        self._a_worker_exited = anyio.Event()
        self._failed = anyio.Event()
        self._failure: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (`_start_workers`) and the tasks that serve and watch them. A start
        that fails half way, or is cancelled, stops what had started, then propagates."""
        check_tensor_parallel(self.config)  # before any worker starts: a wrong size fails at once
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            await self._prepare(stack)
            stack.push_async_callback(self._stop_workers)  # if start-up fails half way
            connections = await self._start_workers()
            task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._stop_workers)  # on the way out: before the task group ends
            self.group = WorkerGroup(connections, self._connection_lost)
            await task_group.start(self.group.run)
            self._start_watchers(task_group)
        except BaseException:
            if not await stack.__aexit__(*sys.exc_info()):
                raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Stop the workers (shielded, time limited), then the tasks. Cancellation does not cut the
        stop short: the workers are stopped either way."""
        stack, self._stack = self._stack, None
        return await stack.__aexit__(*exc_info) if stack else None

    async def aclose(self) -> None:
        await self._stop_workers()

    async def _prepare(self, stack: AsyncExitStack) -> None:
        """What must be open before any worker starts, entered on `stack` (Ray: the cluster)."""

    @abstractmethod
    async def _start_workers(self) -> list[WorkerConnection]:
        """Start every worker and hand it its `Init`; their connections, handshaken, rank order."""

    @abstractmethod
    async def _stop_workers(self) -> None:
        """Stop every worker that started. Shielded: runs to the end even when cancelled."""

    @abstractmethod
    def _start_watchers(self, task_group: TaskGroup) -> None:
        """Start the tasks that notice a worker's death, in `task_group`."""

    @abstractmethod
    async def _connection_lost(self, rank: int) -> None:
        """A worker's socket closed: wait a moment for the reason (its exit), to report it."""

    # ---- start-up ------------------------------------------------------------------------------
    async def _handshake_all(self, connections: list[WorkerConnection], inits: list[Init]) -> None:
        """Send each worker its `Init` and wait for every `Ready` at once: ranks wait for each other
        while joining the process group, so the first failure must stop the wait on the others. A
        failed (or cancelled) handshake closes every connection (shielded) before it propagates."""
        try:
            for conn, init in zip(connections, inits, strict=True):
                await wire.send(conn.stream, init)
            with anyio.fail_after(STARTUP_TIMEOUT):
                await gather_first_failure([partial(self._handshake, conn) for conn in connections])
        except BaseException:
            with anyio.CancelScope(shield=True):
                for conn in connections:
                    await conn.stream.aclose()
            raise

    async def _handshake(self, conn: WorkerConnection) -> None:
        try:
            message = await conn.reader.receive()
        except STREAM_ENDED:  # it exited (perhaps before reading its Init)
            raise ModelLoadError(f"worker rank {conn.rank} exited during start-up "
                                 f"({await self._describe_early_exit(conn.rank)})") from None
        if isinstance(message, StartupFailed):
            raise ModelLoadError(f"worker rank {conn.rank} failed to start:\n{message.error}")
        if not isinstance(message, Ready):
            raise ModelLoadError(f"worker rank {conn.rank} sent {type(message).__name__} instead of Ready")

    async def _describe_early_exit(self, rank: int) -> str:
        """How rank `rank` ended when its stream closed during start-up, in words."""
        return "its connection closed"

    # ---- failure -------------------------------------------------------------------------------
    def _worker_lost(self, error: EngineDeadError) -> None:
        """A worker is gone (`error` names it and how): fail every pending and later call, and the
        engine with the first such error. Nothing while the executor is closing."""
        self._a_worker_exited.set()
        if self._closing or self.group is None:
            return
        self.group.fail(error)
        if self._failure is None:
            self._failure = error
            self._failed.set()

    async def wait_for_failure(self) -> BaseException:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    # ---- the executor interface ----------------------------------------------------------------
    def _workers(self) -> WorkerGroup:
        if self.group is None:
            raise RuntimeError("the executor is not started: use it as an async context manager")
        return self.group

    async def collective_rpc(self, method: RPCMethod, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None, *,
                             timeout: float | None = None,  # noqa: ASYNC109 -- vLLM's collective_rpc signature
                             non_block: bool = False,
                             unique_reply_rank: int | None = None) -> Any:
        # Documented on Executor.collective_rpc; the group does the work.
        return await self._workers().collective_rpc(method, args, kwargs, timeout=timeout, non_block=non_block,
                                                    unique_reply_rank=unique_reply_rank)

    @property
    def driver_rank(self) -> int:
        """The rank that samples and replies to steps: the first of the last pipeline stage."""
        return (self.config.pipeline_parallel_size - 1) * self.config.tensor_parallel_size

    @property
    def max_concurrent_batches(self) -> int:
        """One step per pipeline stage; two with async scheduling (the next one scheduled while
        this one runs: ranks run their calls in order)."""
        return 2 if self.config.schedules_async else self.config.pipeline_parallel_size

    async def load_model(self) -> ModelInfo:
        """Every rank loads its part; the engine sizes the KV cache by the rank whose blocks take
        the most bytes (under pipeline parallelism the stages hold different layers).
        Cancellation stops waiting; the executor is then unusable and must be closed."""
        if self.config.pipeline_parallel_size == 1:
            info: ModelInfo = await self.collective_rpc("load_model", unique_reply_rank=0)
            return info
        infos: list[ModelInfo] = await self.collective_rpc("load_model")
        return max(infos, key=lambda each: each.kv_bytes_per_block)

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        await self.collective_rpc("initialize_kv_cache", (num_blocks,))

    async def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank runs the step; only the driver rank (`driver_rank`) samples and replies.
        Cancellation waits for that reply (the executor's contract), then raises; a worker that
        dies meanwhile fails the call."""
        return await (await self.start_model(sched_out)).result()

    async def start_model(self, sched_out: SchedulerOutput) -> PendingStep:
        """Send the step to every rank now; the driver rank's reply is the `PendingStep`'s output.
        Ranks run their calls in order, so under pipeline parallelism the first stage starts the
        next step while the later stages run this one. Sending does not wait: cancellation cannot
        interrupt it; awaiting the result waits for the step (`PendingStep.result`)."""
        future = self._workers().call("execute_model", (sched_out,), unique_reply_rank=self.driver_rank)

        async def output() -> ModelRunnerOutput:
            try:
                result: ModelRunnerOutput = await future.result()
                return result
            except WorkerError as exc:
                raise await self._root_cause(exc) from exc

        return PendingStep(wait=output)

    async def _root_cause(self, error: WorkerError) -> BaseException:
        """Under tensor parallelism a rank's death shows first as its peers' collective errors
        ("connection reset by peer"): wait a moment for a watcher to name the real cause."""
        if self.world_size > 1:
            with anyio.move_on_after(1.0):
                await self._a_worker_exited.wait()  # set together with the exit's report
        return self.group.failure if self.group is not None and self.group.failure is not None else error


def check_tensor_parallel(config: EngineConfig) -> None:
    """`ModelLoadError` if the model's heads do not split evenly over the tensor-parallel ranks
    (naming sizes that work), or it has fewer layers than pipeline stages."""
    raw = read_config_json(config.model)
    layers = raw.get("num_hidden_layers")
    stages = config.pipeline_parallel_size
    if isinstance(layers, int) and layers < stages:
        raise ModelLoadError(f"--pipeline-parallel-size {stages} is larger than the model's {layers} layers")
    size = config.tensor_parallel_size
    if size == 1:
        return
    heads = raw.get("num_attention_heads")
    if not isinstance(heads, int):
        return  # not a decoder config: the worker reports what it cannot split
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % size or kv_heads % size:
        common = math.gcd(heads, kv_heads)
        sizes = [n for n in range(1, common + 1) if common % n == 0]
        raise ModelLoadError(f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads "
                             f"and {kv_heads} key/value heads; sizes that do: {', '.join(map(str, sizes))}")
