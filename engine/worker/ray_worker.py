"""The worker side of the Ray executor: a Ray actor hosting one rank's worker program.

Ray places the actor (a placement-group bundle), starts its process and tells
us when it dies. Calls do not go through Ray's actor calls: `serve` connects a
TCP socket back to the executor and runs, over it, the same trio worker
program a worker process runs (`engine.worker.worker_main.serve_worker`), until
the executor closes the connection or says `Shutdown`. So every call and reply
takes the same frames and the same ordered path under `ray` as under `mp`
(docs/decisions.md says why: an actor call's round trip measured several times
the socket's). Before `serve`, the actor answers two small calls: where it runs,
and a rendezvous address for torch.distributed on its node.

The first bytes on the socket are `HELLO`: the executor's secret for this
start-up and the rank, checked before the executor unpickles anything from
the connection (the listening port is reachable from the network).
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import trio

from engine.ipc.fast_socket import FastSocketStream
from engine.worker.worker_main import build_worker, serve_worker

HELLO = struct.Struct("!32sI")  # the start-up secret, the rank
SECRET_BYTES = 32


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one rank runs, for the executor's start-up log and its error messages."""

    node_ip: str
    node_id: str
    pid: int
    cpus: tuple[int, ...]

    def describe(self) -> str:
        cpus = ",".join(map(str, self.cpus)) or "any"
        return f"node {self.node_ip} ({self.node_id[:8]}), pid {self.pid}, CPUs {cpus}"


class RayWorker:
    """The actor class (`ray.remote(RayWorker)` in the executor; this module does not import Ray
    until an actor method runs)."""

    def placement(self) -> WorkerPlacement:
        import ray
        cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        node_ip = ray.util.get_node_ip_address()
        return WorkerPlacement(node_ip, ray.get_runtime_context().get_node_id(), os.getpid(), cpus)

    def rendezvous_address(self) -> str:
        """A free port on this actor's node, for rank 0 to host torch.distributed's rendezvous."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((ip, 0))
            return f"tcp://{ip}:{probe.getsockname()[1]}"

    def serve(self, address: tuple[str, int], secret: bytes, rank: int) -> None:
        """Connect to the executor at `address` and serve calls until it closes the connection
        (returns) or says `Shutdown`. Runs for the worker's whole life: this actor answers nothing
        else meanwhile, and the executor awaits the call to learn when the worker ends."""
        trio.run(_serve_connected, address, secret, rank)


async def _serve_connected(address: tuple[str, int], secret: bytes, rank: int) -> None:
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(HELLO.pack(secret, rank))
    async with FastSocketStream(sock, cooperative=False) as stream:
        try:
            await serve_worker(stream, build_worker)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the executor is gone: nobody wants more results
