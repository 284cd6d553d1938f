"""Ordered RPC to a group of workers: one broadcast per call, replies drained in order.

Each call gets a sequence number and, for every worker that will reply, its
own one-slot memory object stream: the call's *reply slot*. Before the call
is written, its slot is appended to that worker's FIFO of pending slots.
Each worker has one writer task (frames leave in the order calls were made)
and one reader task, which owns the worker's reply stream: for every reply
it pops the oldest pending slot, checks that the sequence numbers agree,
and puts the reply into that slot with `send_nowait`, never waiting.

So a reply can only ever reach the call it belongs to. A caller that timed
out or was cancelled closes its slot; its reply is still read, in order,
and dropped. Awaiting a later call before an earlier one is fine: readers
fill slots as replies arrive, whoever is awaiting. (vLLM's `FutureWrapper`
queue let a future that was already done consume the next call's reply;
here there is no shared queue of results to take from.)

When a worker's connection ends or the group is failed, every pending and
later call raises the failure.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from engine.errors import EngineDeadError
from engine.ipc import wire
from engine.ipc.polling import POLL_WINDOW, PollPolicy, now, pollable
from engine.worker.worker_messages import Call, Failure, Reply, RPCMethod, Shutdown, from_wire, to_wire


class WorkerError(RuntimeError):
    """A method raised in a worker. `remote_traceback` is the worker's formatted traceback."""

    def __init__(self, rank: int, failure: Failure) -> None:
        super().__init__(f"worker rank {rank}: {failure.error_type}: {failure.message}")
        self.rank = rank
        self.error_type = failure.error_type
        self.remote_message = failure.message
        self.remote_traceback = failure.traceback
        self.add_note(f"remote traceback (rank {rank}):\n{failure.traceback}")


SlotItem = Reply | Failure | BaseException


# ---- one worker's connection ---------------------------------------------------------------------
class Connection(ABC):
    """One worker as `WorkerGroup` drives it: its FIFO of pending reply slots (oldest first) and
    its failure, shared by every kind (a stream to a worker process here, a Ray actor in
    engine/executor/ray_connection.py), and how calls reach it and replies come back."""

    rank: int

    @abstractmethod
    def post(self, message: Any, seq: int | None = None) -> trio.MemoryReceiveChannel[SlotItem] | None:
        """Send `message` to the worker, in call order; with `seq`, also register and return its
        reply slot. Raises the connection's failure once it has one."""

    @abstractmethod
    async def write_loop(self) -> None:
        """Whatever sending needs a task for; runs until cancelled or the connection breaks."""

    @abstractmethod
    async def read_loop(self) -> None:
        """Put replies into slots in call order (`_deliver_next`) until the connection ends: then
        raise `EOFError` (or a stream error), which fails the group. Runs until cancelled."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release the connection (the group's shutdown); the worker learns it should exit. Called
        shielded: cancellation does not interrupt it."""

    def __init__(self) -> None:
        # (seq, slot, method, sent at) per call awaiting this worker's reply, oldest first
        self.pending: collections.deque[tuple[int, trio.MemorySendChannel[SlotItem], str, float]] = \
            collections.deque()
        self.failure: BaseException | None = None

    def _register(self, seq: int, method: str) -> trio.MemoryReceiveChannel[SlotItem]:
        # (Channels are created unsubscripted: `open_memory_channel[T](...)` costs a typing lookup per call.)
        slot_send, slot = trio.open_memory_channel(1)
        self.pending.append((seq, slot_send, method, now()))
        return slot

    def _deliver_next(self, message: Reply | Failure) -> tuple[str, float]:
        """Put `message` in the oldest pending slot (checking that the sequence numbers agree);
        the call's method and when it was sent. Raises `RuntimeError` when the order is broken."""
        if not self.pending:
            raise RuntimeError(f"worker rank {self.rank} replied to call {message.seq}, which is not pending")
        seq, slot, method, sent_at = self.pending.popleft()
        if message.seq != seq:
            raise RuntimeError(f"worker rank {self.rank} replied to call {message.seq} while call {seq} "
                               "was next: the reply order is broken")
        _deliver(slot, message)
        return method, sent_at

    def fail(self, error: BaseException) -> None:
        """Every pending and later call on this worker raises `error`."""
        if self.failure is None:
            self.failure = error
        while self.pending:
            slot = self.pending.popleft()[1]
            _deliver(slot, self.failure)


class WorkerConnection(Connection):
    """The writer and reader of one worker process's stream."""

    def __init__(self, rank: int, stream: trio.abc.Stream, reader: wire.FrameReader | None = None,
                 poll: bool = True) -> None:
        super().__init__()
        self.rank = rank
        self.stream = stream
        self.reader = reader or wire.FrameReader(stream)
        # Poll the socket for replies of methods that answer within microseconds (see polling.py).
        self.poll = poll
        self.polling = PollPolicy(POLL_WINDOW if poll else 0.0)
        self._pollable = pollable(stream)
        self._outbox_send, self._outbox = trio.open_memory_channel(math.inf)
        self._queued = 0  # items in the outbox that still need writing
        self._writing = False  # the writer task is in the middle of a frame

    def post(self, message: Any, seq: int | None = None) -> trio.MemoryReceiveChannel[SlotItem] | None:
        """Send `message` (now if the socket takes it, else through the writer task, in order);
        with `seq`, also register and return its reply slot."""
        if self.failure is not None:
            raise self.failure
        slot = None if seq is None else self._register(seq, message.method)
        leftover = self._send_now(to_wire(message))
        if leftover != b"":
            self._queued += 1
            self._outbox_send.send_nowait(leftover)
        return slot

    def _register(self, seq: int, method: str) -> trio.MemoryReceiveChannel[SlotItem]:
        """Queue the call's reply slot; poll for the reply if `method` usually answers at once."""
        slot = super()._register(seq, method)
        if self._pollable is not None:
            until = self.polling.poll_until(method, self.pending[-1][3])
            self._pollable.poll_until = max(self._pollable.poll_until, until)
        return slot

    def _send_now(self, message: Any) -> Any:
        """Fast path (no task switch): write a small frame straight to an idle socket. Returns
        what is left for the writer task: the message, the unsent bytes, or b""."""
        try_send = getattr(self.stream, "try_send", None)
        if try_send is None or self._writing or self._queued:
            return message
        pieces = wire.dumps(message)
        if sum(len(p) for p in pieces) > wire.SMALL_PIECE:
            return message
        data = b"".join(pieces)
        return data[try_send(data):]

    async def write_loop(self) -> None:
        """Runs until cancelled (the group's shutdown) or the stream breaks, which fails the group."""
        async for item in self._outbox:
            self._queued -= 1
            self._writing = True
            if isinstance(item, bytes):
                await self.stream.send_all(item)  # the rest of a frame the fast path began
            else:
                await wire.send(self.stream, item)
            self._writing = False

    async def read_loop(self) -> None:
        """Route replies to slots in order until the stream ends (then `fail` with the reason).

        Runs until cancelled (the group's shutdown) or the stream ends, which fails every pending
        call.
        """
        while True:
            message = from_wire(await self.reader.receive())
            if not isinstance(message, (Reply, Failure)):
                raise RuntimeError(f"worker rank {self.rank} sent {type(message).__name__}, expected a reply")
            method, sent_at = self._deliver_next(message)
            # The polling window runs on after this reply even when nothing else is pending: a call
            # made right after it is then polled for too (a reader parked in epoll would not see it).
            self.polling.observe(method, now() - sent_at)

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        self._outbox_send.close()

    async def aclose(self) -> None:
        """Close the stream (the worker sees it end and exits). Cancellation does not interrupt it
        (trio's stream `aclose`)."""
        await self.stream.aclose()


def _deliver(slot: trio.MemorySendChannel[SlotItem], item: SlotItem) -> None:
    try:
        slot.send_nowait(item)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the caller gave up (timeout, cancellation): the reply is dropped here, not passed on
    finally:
        slot.close()


# ---- futures and the group -------------------------------------------------------------------------
class RPCFuture:
    """The result of one `collective_rpc`: a list of per-rank values (or one value for a
    unique reply). Await `result()`; cancellation or the deadline closes the reply slots."""

    def __init__(self, slots: list[tuple[int, trio.MemoryReceiveChannel[SlotItem]]], deadline: float,
                 unique: bool) -> None:
        self._slots = slots
        self._deadline = deadline
        self._unique = unique

    async def result(self) -> Any:
        """The reply (or the error) of this call. Raises `TimeoutError` past the call's deadline.

        Cancellation abandons the call: its replies are read and dropped by the reader task.
        """
        try:
            if self._deadline == math.inf:
                values = [await self._one(rank, slot) for rank, slot in self._slots]
            else:
                with trio.move_on_at(self._deadline) as scope:
                    values = [await self._one(rank, slot) for rank, slot in self._slots]
                if scope.cancelled_caught:
                    raise TimeoutError("the call did not complete before its timeout")
        finally:
            for _, slot in self._slots:
                slot.close()
        return values[0] if self._unique else values

    @staticmethod
    async def _one(rank: int, slot: trio.MemoryReceiveChannel[SlotItem]) -> Any:
        try:
            item = await slot.receive()
        except trio.EndOfChannel:
            raise EngineDeadError(f"worker rank {rank} stopped before replying") from None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Failure):
            raise WorkerError(rank, item)
        return item.value


class WorkerGroup:
    """Ordered collective RPC over a set of worker connections (the transport is any trio stream)."""

    def __init__(self, connections: Sequence[Connection],
                 on_connection_lost: Callable[[int], Awaitable[None]] | None = None) -> None:
        """`on_connection_lost(rank)` runs before a lost connection fails the group, so that its
        owner can fail it with a better reason first (a process's exit status)."""
        self.connections = list(connections)
        self.on_connection_lost = on_connection_lost
        self._seq = itertools.count()
        self.failure: BaseException | None = None
        self.closing = False  # after shutdown(), connections ending is expected
        self._scope: trio.CancelScope | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer and reader tasks of every connection; returns when all have stopped.

        A connection that ends or breaks fails the whole group (a worker group
        is only useful whole); failing the group stops these tasks and closes
        every connection, which tells the remaining workers to exit.

        Cancellation stops every task and closes every connection (shielded), which tells the
        workers to exit.
        """
        try:
            async with trio.open_nursery() as tg:
                self._scope = tg.cancel_scope
                if self.failure is not None:
                    tg.cancel_scope.cancel()
                for conn in self.connections:
                    tg.start_soon(self._serve, conn)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                for conn in self.connections:
                    await conn.aclose()

    async def _serve(self, conn: Connection) -> None:
        async with trio.open_nursery() as tg:
            tg.start_soon(self._guard, conn, conn.write_loop)
            await self._guard(conn, conn.read_loop)
            tg.cancel_scope.cancel()

    async def _guard(self, conn: Connection, loop: Callable[[], Awaitable[None]]) -> None:
        try:
            await loop()
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if not self.closing and self.on_connection_lost is not None:
                await self.on_connection_lost(conn.rank)
            reason = "was shut down" if self.closing else f"connection ended: {exc}"
            self.fail(EngineDeadError(f"worker rank {conn.rank} {reason}"))
        except RuntimeError as exc:
            self.fail(EngineDeadError(str(exc)))

    def fail(self, error: BaseException) -> None:
        """Fail every pending and later call with `error` (the first failure wins)."""
        if self.failure is None:
            self.failure = error
        for conn in self.connections:
            conn.fail(self.failure)
        if self._scope is not None:
            self._scope.cancel()

    def call(self, method: RPCMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *,
             timeout: float | None = None, unique_reply_rank: int | None = None) -> RPCFuture:
        """Broadcast one call now and return its future (this is `collective_rpc(non_block=True)`)."""
        if self.failure is not None:
            raise self.failure
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < len(self.connections):
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is not a rank of this group")
        seq = next(self._seq)
        message = Call(seq, method, tuple(args), dict(kwargs or {}), unique_reply_rank)
        slots = []
        for conn in self.connections:
            replies = unique_reply_rank is None or conn.rank == unique_reply_rank
            slot = conn.post(message, seq if replies else None)
            if slot is not None:
                slots.append((conn.rank, slot))
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        return RPCFuture(slots, deadline, unique_reply_rank is not None)

    async def collective_rpc(self, method: RPCMethod, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None, *,
                             timeout: float | None = None,  # noqa: ASYNC109 -- vLLM's collective_rpc signature
                             non_block: bool = False,
                             unique_reply_rank: int | None = None) -> Any:
        """Call `method` on every worker. Returns the list of results in rank order (or the one
        result of `unique_reply_rank`), or with `non_block` an `RPCFuture` to await later.

        `timeout` covers the whole call. Cancelling the caller abandons the
        call: its replies are read and dropped; later calls are unaffected.
        A worker's exception is raised as `WorkerError` with its traceback.
        """
        future = self.call(method, args, kwargs, timeout=timeout, unique_reply_rank=unique_reply_rank)
        return future if non_block else await future.result()

    def shutdown(self) -> None:
        """Ask every worker to exit once the calls before this are done."""
        self.closing = True
        for conn in self.connections:
            if conn.failure is None:
                # A connection already closed (the group was cancelled) has told its worker to exit.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    conn.post(Shutdown())
