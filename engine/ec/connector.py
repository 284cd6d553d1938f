"""The scheduler side of the shared-storage EC connector, and the admission gate that asks it.

The scheduler asks, for each waiting request with images, `ensure_cache_available(request,
num_computed_tokens)`: cheap and idempotent (it is asked every step), it looks only at images
at or after `num_computed_tokens`. An image the engine's encoder cache holds, one already
loaded, or one the store does not have (it is encoded locally) is ready. One the store has
starts loading: a task in the connector's task group reads the file in a worker thread, and the
answer is False ("not yet") until it is in memory. The scheduler then skips the request for
this step (`step_skipped_waiting`) and everything behind it runs. When a load ends the
connector wakes the engine core so an idle engine schedules at once.

A load that takes longer than `defer_timeout` fails the requests that need that image (and only
them) with a clear error. A damaged file is logged and the image encoded locally: the store is
a cache, never a reason to crash.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine.config import ECTransferConfig
from engine.ec.storage import entry_path, load_rows
from engine.sched.request import Request
from engine.sched.scheduler import Admission

logger = logging.getLogger(__name__)

Loader = Callable[[Path], Awaitable[Any]]


class SharedStorageConnector:
    """Scheduler side, consumer role. `run` is its task; the other methods are called by the
    engine-core task only (the scheduler and its gate), so its state has one owner."""

    def __init__(self, config: ECTransferConfig, defer_timeout: float, wake: Callable[[], None],
                 loader: Loader | None = None) -> None:
        self.root = Path(config.storage_path)
        self.consumer = config.is_consumer
        self.defer_timeout = defer_timeout
        self.wake = wake
        self._limiter = anyio.CapacityLimiter(2)
        self.loader: Loader = loader or self._read_in_thread
        self.has_local: Callable[[str], bool] = lambda mm_hash: False  # the scheduler's encoder cache
        self._loaded: dict[str, Any] = {}
        self._pending: set[str] = set()
        self._local: set[str] = set()  # not in the store, or unreadable there: encode here
        self._failed: dict[str, str] = {}
        self._handing_over: dict[str, Any] = {}
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[str](math.inf)
        self.loads = 0  # encoder outputs taken from the store (metrics)
        self.deferrals = 0  # times a request was skipped for a step while its images loaded

    # ---- scheduler side ------------------------------------------------------------------
    def has_cache_item(self, mm_hash: str) -> bool:
        """Whether the store holds `mm_hash` (one stat; each hash is asked about once)."""
        return self.consumer and entry_path(self.root, mm_hash).is_file()

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """True when every image of `request` from `num_computed_tokens` on can be had now; else
        starts what loads are missing and answers False. Never blocks."""
        ready = True
        for feature in request.mm_features:
            mm_hash = feature.mm_hash
            if feature.end <= num_computed_tokens or mm_hash in self._loaded or mm_hash in self._local:
                continue
            if mm_hash in self._failed or self.has_local(mm_hash):
                continue
            if mm_hash in self._pending:
                ready = False
            elif self.has_cache_item(mm_hash):
                self._pending.add(mm_hash)
                self._inbox_send.send_nowait(mm_hash)
                ready = False
            else:
                self._local.add(mm_hash)
        return ready

    def failure(self, request: Request) -> str | None:
        """Why `request` cannot be served (an image that did not arrive in time), or None."""
        return next((self._failed[f.mm_hash] for f in request.mm_features if f.mm_hash in self._failed), None)

    def loaded(self, mm_hash: str) -> Any | None:
        """An encoder output loaded from the store and not yet handed to the worker."""
        return self._loaded.get(mm_hash)

    def update_state_after_alloc(self, mm_hash: str) -> None:
        """The scheduler reserved encoder-cache room for a loaded output: it goes to the worker
        with this step (`build_connector_meta`)."""
        rows = self._loaded.pop(mm_hash, None)
        if rows is not None:
            self._handing_over[mm_hash] = rows
            self.loads += 1

    def build_connector_meta(self) -> dict[str, Any]:
        """What the worker adopts into its encoder cache with this step: mm_hash -> rows."""
        meta, self._handing_over = self._handing_over, {}
        return meta

    def request_finished(self, request: Request) -> None:
        """Forget failures no other request can need (a failed image is retried by a new request)."""
        for feature in request.mm_features:
            self._failed.pop(feature.mm_hash, None)

    # ---- the task ------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load what `ensure_cache_available` asks for, each load a task of its own.

        Cancellation (the engine closing) cancels the loads in flight; a file read already running
        in a thread finishes and its result is dropped."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            async for mm_hash in self._inbox:
                tg.start_soon(self._load, mm_hash)

    async def _load(self, mm_hash: str) -> None:
        with anyio.move_on_after(self.defer_timeout) as scope:
            try:
                self._loaded[mm_hash] = await self.loader(entry_path(self.root, mm_hash))
            except Exception as exc:
                logger.warning("encoder cache entry %s could not be loaded (%s); encoding it locally", mm_hash, exc)
                self._local.add(mm_hash)
        if scope.cancelled_caught:
            self._failed[mm_hash] = (f"the encoder output of image {mm_hash[:16]} did not arrive from the EC "
                                     f"connector within {self.defer_timeout:g} s (--ec-defer-timeout)")
        self._pending.discard(mm_hash)
        self.wake()

    async def _read_in_thread(self, path: Path) -> Any:
        return await anyio.to_thread.run_sync(load_rows, path, limiter=self._limiter)

    def close(self) -> None:
        self._inbox_send.close()


class ECConnectorGate:
    """The scheduler's admission gate for requests whose images come through the connector."""

    def __init__(self, connector: SharedStorageConnector, blocking: bool = False) -> None:
        self.connector = connector
        # blocking: a request waiting for its images holds up every request behind it (the baseline
        # `trio-llm bench ec` compares the non-blocking deferral with)
        self.blocking = blocking

    def admit(self, request: Request) -> Admission:
        if not request.mm_features:
            return Admission.READY
        if self.connector.failure(request) is not None:
            return Admission.FAILED
        if self.connector.ensure_cache_available(request, request.num_computed_tokens):
            return Admission.READY
        self.connector.deferrals += 1
        return Admission.WAIT if self.blocking else Admission.NOT_YET

    def rejection_reason(self, request: Request) -> str:
        """Why the request failed; the failure is then forgotten, so a later request for the same
        image tries the store again."""
        reason = self.connector.failure(request) or "the request's images could not be had"
        self.connector.request_finished(request)
        return reason
