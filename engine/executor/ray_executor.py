"""The Ray executor (`--distributed-executor-backend ray`): worker processes as Ray actors.

Ray places the workers and owns their processes; the rest is the multi-process
executor's (engine/executor/worker_group.py):
- start: connect to the Ray cluster (`RAY_ADDRESS`, else a local one this
  executor starts and stops: engine/executor/ray_cluster.py), reserve a
  placement group of one bundle per rank (`STRICT_PACK`: tensor-parallel ranks share a node), start one
  `RayWorker` actor per bundle, log where each rank runs, then have every
  actor connect back to a TCP listener here (secret checked first) and serve
  the usual worker program over it. Torch's process group rendezvous on rank
  0's node.
- serving: calls and replies are frames on those sockets, through the same
  ordered `WorkerGroup` as worker processes. Each actor's `serve` call stays
  in flight for the worker's whole life; a task per rank awaits it
  (engine/executor/ray_refs.py: no thread per call), so an actor that dies,
  busy or idle, fails every pending and later call at once, named by rank,
  node and pid, with Ray's reason. A lost node shows as the socket's
  keepalive failing (seconds) or Ray's own node-death report, whichever is
  first.
- stop (also on cancellation; shielded and time-limited): `Shutdown` to
  every worker, wait, kill the actors, remove the placement group, and
  disconnect from (or stop) the Ray cluster. Actors are owned by this
  process: if it dies, Ray kills them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from contextlib import AsyncExitStack, suppress
from dataclasses import replace
from functools import partial
from typing import Any

import anyio
import ray
import trio
from anyio.abc import TaskGroup
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import engine.executor.ray_refs as ray_refs
from engine.concurrency.gather import gather_first_failure
from engine.config import EngineConfig, usable_cpus
from engine.errors import EngineDeadError, ModelLoadError
from engine.executor.ray_cluster import first_line, ray_connected
from engine.executor.rpc import WorkerConnection
from engine.executor.worker_group import STARTUP_TIMEOUT, WorkerGroupExecutor
from engine.ipc.fast_socket import FastSocketStream
from engine.ipc.process import SHUTDOWN_GRACE
from engine.worker.ray_worker import HELLO, SECRET_BYTES, RayWorker, WorkerPlacement
from engine.worker.worker_messages import Init

log = logging.getLogger("trio_llm.executor")

PLACEMENT_TIMEOUT = 60.0  # a cluster without room for the bundles never places them: say so
CONNECTION_LOST_GRACE = 1.0  # seconds a closed worker socket waits for Ray to say how its actor ended
KEEPALIVE = (1, 1, 3)  # seconds idle, seconds between probes, probes: a silent node is lost in ~4 s
# Environment the actors get from this process: Ray starts them from its raylet's environment,
# which on another node is not ours.
FORWARDED_ENV_PREFIXES = ("TRIO_LLM_", "TORCHINDUCTOR_")


class RayExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        # The driver's CPU layout names this machine's CPUs; a worker's are its bundle's.
        self.config = replace(config, cpu_layout=None)
        self.world_size = config.world_size
        self.threads_per_worker = max(1, usable_cpus() // self.world_size)
        self.actors: list[Any] = []
        self.placements: list[WorkerPlacement] = []
        self._serving: list[Any] = []  # each actor's `serve` ObjectRef
        self._ended: list[anyio.Event] = []
        self._alive: list[bool] = []
        self._pg: Any = None
        self._node_id = ""  # this process's Ray node
        self._stopped = False
        self._watchers: anyio.CancelScope | None = None

    # ---- lifecycle (WorkerGroupExecutor.__aenter__) --------------------------------------------
    async def _prepare(self, stack: AsyncExitStack) -> None:
        """Join (or start) the Ray cluster, for as long as the executor is open."""
        await stack.enter_async_context(ray_connected(self.world_size * self.threads_per_worker))
        self._node_id = ray.get_runtime_context().get_node_id()

    def _start_watchers(self, task_group: TaskGroup) -> None:
        self._watchers = task_group.cancel_scope
        for rank in range(self.world_size):
            task_group.start_soon(self._watch, rank)

    async def _place_actors(self) -> None:
        bundles = [{"CPU": self.threads_per_worker} for _ in range(self.world_size)]
        # A stage's tensor-parallel ranks talk every layer: one node. Pipeline stages talk once a
        # step: they may spread over nodes when one cannot hold them all.
        packing = "STRICT_PACK" if self.config.pipeline_parallel_size == 1 else "PACK"
        self._pg = placement_group(bundles, strategy=packing)
        with anyio.move_on_after(PLACEMENT_TIMEOUT) as placing:
            await ray_refs.get(self._pg.ready())
        if placing.cancelled_caught:
            raise ModelLoadError(
                f"the Ray cluster found no node with room for {self.world_size} worker(s) of "
                f"{self.threads_per_worker} CPU(s) each within {PLACEMENT_TIMEOUT:.0f} s (`ray status` shows "
                "what each node has free)")
        actor_class = ray.remote(RayWorker)
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(
                num_cpus=self.threads_per_worker, max_restarts=0, scheduling_strategy=strategy,
                runtime_env={"env_vars": env}).remote())
        self.placements = await gather_first_failure(
            [partial(ray_refs.get, actor.placement.remote()) for actor in self.actors])
        for rank, placement in enumerate(self.placements):
            log.info("worker rank %d (stage %d, Ray actor): %s", rank, rank // self.config.tensor_parallel_size,
                     placement.describe())

    async def _start_workers(self) -> list[WorkerConnection]:
        """The actors placed; every one connects back and serves; then the usual handshake. An actor
        that fails before connecting fails the start with its error."""
        await self._place_actors()
        init_method = await ray_refs.get(self.actors[0].rendezvous_address.remote()) if self.world_size > 1 else None
        secret = secrets.token_bytes(SECRET_BYTES)
        node_ip = ray.util.get_node_ip_address()
        with socket.create_server((node_ip, 0)) as listener:
            listener.setblocking(False)
            address = listener.getsockname()[:2]
            for rank, actor in enumerate(self.actors):
                self._serving.append(actor.serve.remote(address, secret, rank))
                self._ended.append(anyio.Event())
                self._alive.append(True)
            with anyio.fail_after(STARTUP_TIMEOUT):
                streams = await self._accept_all(listener, secret)
        poll = self.world_size + 1 <= usable_cpus()
        connections = [WorkerConnection(rank, streams[rank], poll=poll) for rank in range(self.world_size)]
        inits = [Init(rank, self.world_size, self.config, init_method, self.threads_per_worker, poll)
                 for rank in range(self.world_size)]
        await self._handshake_all(connections, inits)
        return connections

    async def _accept_all(self, listener: socket.socket, secret: bytes) -> dict[int, FastSocketStream]:
        streams: dict[int, FastSocketStream] = {}
        failure: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            for rank in range(self.world_size):
                tg.start_soon(self._fail_start_if_serve_ends, rank, failure, tg.cancel_scope)
            while len(streams) < self.world_size:
                await trio.lowlevel.wait_readable(listener)
                with suppress(BlockingIOError):
                    sock, _ = listener.accept()
                    hello_rank = await _check_hello(sock, secret, self.world_size)
                    if hello_rank is None or hello_rank in streams:
                        sock.close()
                        continue
                    streams[hello_rank] = FastSocketStream(_tuned(sock))
            tg.cancel_scope.cancel()
        if failure:
            for stream in streams.values():
                stream.socket.close()
            raise failure[0]
        return streams

    async def _fail_start_if_serve_ends(self, rank: int, failure: list[BaseException],
                                        start: anyio.CancelScope) -> None:
        failure.append(ModelLoadError(f"worker rank {rank} failed to start: {await self._how_serve_ended(rank)}"))
        start.cancel()

    async def _how_serve_ended(self, rank: int) -> str:
        """Wait for rank `rank`'s `serve` call to end; how it did, in words."""
        outcome = await ray_refs.settled(self._serving[rank])
        error = outcome.exception()
        return "its worker returned" if error is None else f"{type(error).__name__}: {first_line(error)}"

    async def _describe_early_exit(self, rank: int) -> str:
        with anyio.move_on_after(SHUTDOWN_GRACE):
            return await self._how_serve_ended(rank)
        return "its connection closed"

    async def _watch(self, rank: int) -> None:
        """Await the actor's `serve` call: it ends only when the executor closes the worker, or
        when the worker or its actor dies."""
        how = await self._how_serve_ended(rank)
        self._ended[rank].set()
        self._lost(rank, how)

    def _lost(self, rank: int, how: str) -> None:
        self._alive[rank] = False
        where = self.placements[rank].describe() if rank < len(self.placements) else "Ray actor"
        self._worker_lost(EngineDeadError(f"worker rank {rank} ({where}) ended unexpectedly: {how}"))

    async def _connection_lost(self, rank: int) -> None:
        """A worker's socket closed: its actor is probably dying; wait a moment for Ray's reason,
        then fail the engine without it (on a busy machine Ray has taken more than a second to
        report a killed actor, and the engine must not serve on meanwhile)."""
        with anyio.move_on_after(CONNECTION_LOST_GRACE):
            await self._ended[rank].wait()
        if not self._ended[rank].is_set():
            self._lost(rank, f"its connection closed (Ray had not reported why within {CONNECTION_LOST_GRACE:g} s)")

    async def _stop_workers(self) -> None:
        """`Shutdown`, wait, kill the actors and wait until Ray reports them dead, remove the
        placement group, leave the Ray cluster. Shielded: runs to the end even when cancelled."""
        if self._stopped:
            return
        with anyio.CancelScope(shield=True):
            self._stopped = self._closing = True
            group = self.group
            if group is not None and group.failure is None:
                group.shutdown()
            with anyio.move_on_after(SHUTDOWN_GRACE):
                for ended in self._ended:
                    await ended.wait()
            if group is not None:
                group.fail(EngineDeadError("the executor was closed"))
            actors, pg, self.actors, self._pg = self.actors, self._pg, [], None
            await anyio.to_thread.run_sync(_kill, actors)
            with anyio.move_on_after(SHUTDOWN_GRACE):
                for actor in actors:  # a call to a killed actor fails once Ray has seen it end
                    await ray_refs.settled(actor.__ray_ready__.remote())
                for placement in self.placements:  # and this node's worker processes are gone
                    if placement.node_id == self._node_id:
                        await _process_ended(placement.pid)
            if pg is not None:
                await anyio.to_thread.run_sync(_remove_placement_group, pg)
            if self._watchers is not None:
                self._watchers.cancel()  # a `serve` call Ray no longer reports on must not hold the exit

    def workers_alive(self) -> tuple[bool, ...]:
        return tuple(self._alive)

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(placement.pid for placement in self.placements)


def _kill(actors: list[Any]) -> None:
    for actor in actors:
        with suppress(Exception):  # already dead
            ray.kill(actor)


def _remove_placement_group(pg: Any) -> None:
    with suppress(Exception):  # the cluster is gone already
        remove_placement_group(pg)


async def _check_hello(sock: socket.socket, secret: bytes, world_size: int) -> int | None:
    """Read the connection's `HELLO`; its rank if the secret matches, else None."""
    data = b""
    with anyio.move_on_after(5.0):
        while len(data) < HELLO.size:
            await trio.lowlevel.wait_readable(sock)
            chunk = sock.recv(HELLO.size - len(data))
            if not chunk:
                return None
            data += chunk
    if len(data) < HELLO.size:
        return None
    their_secret, rank = HELLO.unpack(data)
    if not secrets.compare_digest(their_secret, secret) or not 0 <= rank < world_size:
        return None
    return int(rank)


async def _process_ended(pid: int) -> None:
    """Wait until process `pid` (of this node) has exited; at once where pidfds do not exist."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, ProcessLookupError):
        return
    try:
        await trio.lowlevel.wait_readable(fd)  # readable once the process has exited
    finally:
        os.close(fd)


def _tuned(sock: socket.socket) -> socket.socket:
    """No Nagle delay on small frames; keepalive so that a lost node breaks the connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    with suppress(AttributeError, OSError):  # Linux names; elsewhere the OS defaults apply
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    return sock

