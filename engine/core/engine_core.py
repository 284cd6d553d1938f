"""The engine core: one task owns the scheduler and the request registry.

Other tasks never touch them. They talk to the core through one memory object
stream of messages (add a request, abort a request), sent with `send_nowait`
on an unbounded buffer so a caller never blocks on the core and an abort can
be sent from a `finally` block without awaiting. Messages are applied between
steps, so an abort never races a step in flight; its KV blocks are free
before the next step is scheduled.

Each request's outputs go back through its own memory object stream. Items
are `RequestOutput`s or an exception for the consumer to raise; the stream
closes after the final output.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from engine.concurrency.use_counts import UseCounts
from engine.core.eplb_driver import EplbDriver
from engine.core.output_processor import RequestTracker
from engine.core.request_timings import RequestTimings
from engine.core.stats import EngineStats, NullObserver, StatsObserver
from engine.core_request import EngineCoreRequest
from engine.errors import EngineDeadError, InvalidRequestError, LoRAError, RequestFailedError
from engine.executor.base import Executor, PendingStep
from engine.executor.rpc import WorkerError
from engine.executor.streamed_burst import StreamedBurst
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.render.tokenizer import Tokenizer
from engine.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)

OutputItem = RequestOutput | PoolingRequestOutput | BaseException


class OutputSender(Protocol):
    """Where one request's outputs go: a memory object send stream in process (its consumer's), or
    the engine process's outbox, which ships a step's outputs to the server process in one frame."""

    def send_nowait(self, item: OutputItem) -> None:
        """Deliver without waiting; `anyio.BrokenResourceError` if the consumer has gone."""

    def close(self) -> None:
        """No more outputs for this request."""


@dataclass
class AddRequest:
    request: EngineCoreRequest
    outputs: OutputSender

    @property
    def request_id(self) -> str:
        return self.request.request_id


def scheduler_requests(request: EngineCoreRequest) -> list[Request]:
    """The scheduler's requests for `request`: one, or with `n` samples the children "id-0", "id-1",
    ... with distinct seeds. Built inside the core, which alone mutates them."""
    params = request.sampling_params
    if request.pooling_params is not None or params.n == 1:
        children = [(request.request_id, params)]
    else:
        children = [(f"{request.request_id}-{i}", params.for_child(i)) for i in range(params.n)]
    return [Request(child_id, list(request.prompt_token_ids), child_params, arrival_time=request.arrival_time,
                    priority=request.priority, max_tokens=request.max_tokens, cache_key=request.cache_key,
                    prompt_embeds=request.prompt_embeds, mm_features=list(request.mm_features),
                    pooling_params=request.pooling_params,
                    token_type_ids=None if request.token_type_ids is None else list(request.token_type_ids),
                    lora_name=request.lora_name)
            for child_id, child_params in children]


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Wake:
    """Something the scheduler waits on changed (an EC connector finished a load): schedule again."""


@dataclass
class ExecutorFailed:
    """The executor lost a worker while the core may be idle: the core stops with this error."""

    error: BaseException


CoreMessage = AddRequest | AbortRequest | ExecutorFailed | Wake


@dataclass
class _StepInFlight:
    sched_out: SchedulerOutput
    pending: PendingStep
    adopted: Any  # what the EPLB driver committed for this step (None without EPLB)


class CoreHandle(Protocol):
    """What `AsyncEngine` drives: an `EngineCore` in this process, the client of one in the
    engine process (`engine.core.core_client.CoreClient`), or several behind data parallelism
    (`engine.core.data_parallel.DataParallelCores`). Its plain methods and properties never block;
    the LoRA calls wait for the workers."""

    @property
    def dead(self) -> bool:
        """The core has stopped: it takes no more requests."""

    def submit(self, message: AddRequest) -> None:
        """Queue a request; `EngineDeadError` once the core has stopped."""

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it finished or the core stopped)."""

    def stats(self) -> EngineStats:
        """A snapshot, without loop lag."""

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's snapshot, in data-parallel rank order (one engine: `[stats()]`)."""

    @property
    def pids(self) -> tuple[int, ...]:
        """The engine processes' pids, in data-parallel rank order; none for a core in this process."""

    async def add_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter on every worker (`EngineCore.add_lora`). Cancellation stops the
        wait; the workers may still load it."""

    async def remove_lora(self, name: str) -> None:
        """Stop serving a LoRA adapter once no request uses it (`EngineCore.remove_lora`).
        Cancellation stops the wait."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Tokenizer,
                 observer: StatsObserver | None = None, eplb: EplbDriver | None = None) -> None:
        self.scheduler = scheduler
        self.eplb = eplb  # expert load balancing: consulted at every step boundary
        self.executor = executor
        self.tokenizer = tokenizer
        self.observer: StatsObserver = observer or NullObserver()
        self.timings = RequestTimings(self.observer)
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[CoreMessage](math.inf)
        self._trackers: dict[str, RequestTracker] = {}
        self._streams: dict[str, OutputSender] = {}
        self._child_owner: dict[str, RequestTracker] = {}
        # Set once the worker's graphs are what steps will run on for good: at once, unless they
        # compile in a child process meanwhile (engine/core/background_compile.py).
        self.graphs_settled = anyio.Event()
        self.dead = False
        # Steps started and not yet published, oldest first: at most the executor's
        # max_concurrent_batches (one per pipeline stage).
        self._in_flight: collections.deque[_StepInFlight] = collections.deque()
        self.num_steps = 0
        self._idle = anyio.Event()  # set while the core has no work and waits for messages
        # Requests submitted with each LoRA adapter and not yet ended (queued messages included):
        # an adapter is removed from the workers only once none is left.
        self._adapter_users = UseCounts()

    # ---- called from other tasks: never block ------------------------------------------
    def submit(self, message: CoreMessage) -> None:
        """Queue a message for the core. Raises `EngineDeadError` once the core has stopped."""
        try:
            self._inbox_send.send_nowait(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise EngineDeadError("the engine has stopped") from None
        if isinstance(message, AddRequest) and message.request.lora_name is not None:
            self._adapter_users.acquire(message.request.lora_name)

    def executor_failed(self, error: BaseException) -> None:
        """Stop the core with `error` (from the executor's watcher task), busy or idle."""
        if not self.dead:
            self.submit(ExecutorFailed(error))

    def wake(self) -> None:
        """Have the core schedule again (from a task whose news may unblock a waiting request)."""
        if not self.dead:
            self.submit(Wake())

    def abort(self, request_id: str) -> None:
        """Abort a request if the core still runs; a no-op after it stopped."""
        if not self.dead:
            self.submit(AbortRequest(request_id))

    # ---- the task --------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop. Cancelling it stops the engine: every open request gets
        `EngineDeadError`. A step in flight finishes first (the worker must stay consistent)."""
        task_status.started()
        failure: BaseException | None = None
        try:
            while True:
                if not self.scheduler.has_work() and not self._in_flight:
                    await self._wait_for_message()
                self._drain_inbox()
                # Fill the pipeline (one step per stage; one step without pipeline stages), then
                # publish the oldest: messages are applied between a step's outputs and the next.
                while len(self._in_flight) < self.executor.max_concurrent_batches and \
                        self.scheduler.has_work() and await self._launch():
                    pass
                if self._in_flight:
                    await self._finish_oldest()
                elif self.scheduler.has_work():
                    # Work exists but none is schedulable (deferred by a gate): wait for news.
                    await self._wait_for_message()
        except anyio.EndOfStream:
            pass
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._shutdown(failure)

    async def _wait_for_message(self) -> None:
        self._idle.set()
        message = await self._inbox.receive()
        self._idle = anyio.Event()
        self._apply(message)

    async def wait_until_idle(self) -> None:
        """Return once every submitted message is applied and no request is left.

        Cancellation just stops the wait."""
        while not (self._idle.is_set() and self.num_pending_messages == 0):
            if self._idle.is_set():
                await anyio.lowlevel.checkpoint()  # the core has a message to pick up: let it run
            else:
                await self._idle.wait()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.receive_nowait()
            except anyio.WouldBlock:
                return
            self._apply(message)

    def _apply(self, message: CoreMessage) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, ExecutorFailed):
            raise message.error
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)

    def _add(self, message: AddRequest) -> None:
        if message.request_id in self._trackers:
            error = InvalidRequestError(f"request id {message.request_id!r} is already in use", param="request_id",
                                        request_id=message.request_id)
            message.outputs.send_nowait(error)
            message.outputs.close()
            self._adapter_user_gone(message.request.lora_name)
            return
        children = scheduler_requests(message.request)
        tracker = RequestTracker(message.request, children, self.tokenizer)
        self._trackers[message.request_id] = tracker
        self._streams[message.request_id] = message.outputs
        for child in children:
            self._child_owner[child.request_id] = tracker
            self.scheduler.add_request(child)

    def _abort(self, request_id: str) -> None:
        tracker = self._trackers.get(request_id)
        if tracker is None:
            return
        child_ids = [c.request.request_id for c in tracker.children]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self.timings.finished(tracker, "abort", anyio.current_time())
        self._forget(request_id)

    def _fail_requests(self, failures: dict[str, str]) -> None:
        """Requests the worker could not run: each fails with `RequestFailedError` (all of its
        samples are aborted); the rest of the step stands."""
        for child_id, reason in failures.items():
            tracker = self._child_owner.get(child_id)
            if tracker is None or tracker.request_id not in self._trackers:
                continue
            logger.warning("request %s failed in the worker and was dropped: %s", tracker.request_id, reason)
            error = RequestFailedError(f"request {tracker.request_id} failed in the engine: {reason}",
                                       request_id=tracker.request_id)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                self._streams[tracker.request_id].send_nowait(error)
            child_ids = [c.request.request_id for c in tracker.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.timings.finished(tracker, "error", anyio.current_time())
            self._forget(tracker.request_id)

    def _forget(self, request_id: str) -> None:
        tracker = self._trackers.pop(request_id)
        for child in tracker.children:
            self._child_owner.pop(child.request.request_id, None)
        self._streams.pop(request_id).close()
        self._adapter_user_gone(tracker.children[0].request.lora_name)

    def _adapter_user_gone(self, lora_name: str | None) -> None:
        if lora_name is not None:
            self._adapter_users.release(lora_name)

    # ---- LoRA adapters ---------------------------------------------------------------------
    async def add_lora(self, name: str, path: str) -> None:
        """Serve LoRA adapter `name` from directory `path` on every worker, replacing one of that
        name. A bad adapter raises `LoRAError` and changes nothing. Workers read it between steps.

        Cancellation abandons the call: the workers may still load it."""
        if self.dead:
            raise EngineDeadError("the engine has stopped")
        try:
            await self.executor.collective_rpc("add_lora", (name, path))
        except WorkerError as exc:  # a worker process's refusal, by its type
            if exc.error_type == LoRAError.__name__:
                raise LoRAError(exc.remote_message) from None
            raise

    async def remove_lora(self, name: str) -> None:
        """Stop serving LoRA adapter `name` on every worker once no request submitted with it is
        left: those running or queued finish as they would, never losing their weights. Submit no
        new request for it meanwhile.

        Cancellation stops the wait; the adapter stays loaded."""
        await self._adapter_users.wait_unused(name)
        if not self.dead:
            await self.executor.collective_rpc("remove_lora", (name,))

    # ---- one step --------------------------------------------------------------------------
    async def step(self) -> bool:
        """Schedule, run the model, publish outputs. Returns False if nothing was schedulable.

        Cancellation waits for the step in flight to end (the executor's contract), then propagates;
        the core task's owner fails every open request with `EngineDeadError`.
        """
        launched = await self._launch()
        while self._in_flight:
            await self._finish_oldest()
        return launched

    async def _launch(self) -> bool:
        """Schedule a step and start it on the executor (`Executor.start_model`), without waiting
        for its output (an executor that runs one step at a time runs it here). False if nothing
        was schedulable (and no request was rejected). Cancellation: as `Executor.start_model`."""
        sched_out = self.scheduler.schedule()
        rejected = self.scheduler.take_rejected()
        if rejected:
            self._fail_requests(rejected)
        if sched_out.is_empty:
            return bool(rejected)
        self._report_scheduled(sched_out.new_requests, anyio.current_time())
        adopted = self.eplb.before_step(sched_out) if self.eplb is not None else None
        self._in_flight.append(_StepInFlight(sched_out, await self.executor.start_model(sched_out), adopted))
        return True

    async def _finish_oldest(self) -> None:
        """Await the oldest step in flight and publish its outputs. Cancellation waits for that
        step to end, then propagates."""
        step = self._in_flight[0]
        if isinstance(step.pending, StreamedBurst):
            await self._finish_streamed_burst(step, step.pending)
            return
        result = await step.pending.result()
        self._in_flight.popleft()
        if self.eplb is not None:
            await self.eplb.after_step(step.adopted, result.expert_load)
        if result.failed:
            self._fail_requests(result.failed)
        updates = self.scheduler.update_from_output(step.sched_out, result)
        self.num_steps += 1
        self.observer.on_step(iteration_tokens(updates))
        self._publish(updates, anyio.current_time())

    async def _finish_streamed_burst(self, step: _StepInFlight, burst: StreamedBurst) -> None:
        """Run a decode burst, publishing each step's tokens while the next computes. It ends early
        once a request in it has finished or a message waits (a new request joins at the next
        step, an abort lands there). Cancellation: as `StreamedBurst.run`."""
        steps_taken = 0

        def take(tokens: ModelRunnerOutput) -> bool:
            nonlocal steps_taken
            updates = self.scheduler.update_from_burst_step(step.sched_out, tokens, first=steps_taken == 0)
            steps_taken += 1
            self.observer.on_step(iteration_tokens(updates))
            self._publish(updates, anyio.current_time())
            return self.num_pending_messages == 0 and all(self.scheduler.is_running(item.request_id)
                                                          for item in step.sched_out.scheduled)

        result = await burst.run(take)  # no EPLB here: bursts run with one worker, EPLB with several
        self._in_flight.popleft()
        if result.failed:
            self._fail_requests(result.failed)
        self.num_steps += 1

    def _publish(self, updates: list[RequestUpdate], now: float) -> None:
        touched: dict[str, RequestTracker] = {}
        new_tokens: dict[str, int] = {}
        for update in updates:
            tracker = self._child_owner.get(update.request.request_id)
            if tracker is None:
                continue
            if update.request.pooling_params is not None:
                self._publish_pooled(tracker, update, now)
                continue
            self._apply_update(tracker, update)
            touched[tracker.request_id] = tracker
            new_tokens[tracker.request_id] = new_tokens.get(tracker.request_id, 0) + len(update.new_token_ids)
        for rid, tracker in touched.items():
            self.timings.tokens(tracker, new_tokens[rid], now)
            if tracker.finished:
                tracker.metrics["finished_time"] = now
                self.timings.finished(tracker, tracker.children[0].finish_reason or "stop", now)
            output = tracker.build_output()
            delivered = output is None or self._send(rid, output)
            if tracker.finished:
                self._forget(rid)
            elif not delivered:
                self._abort(rid)  # the consumer went away without saying so

    def _publish_pooled(self, tracker: RequestTracker, update: RequestUpdate, now: float) -> None:
        """A pooling request finishes in the step that computed its prompt: one output, then done."""
        tracker.metrics["finished_time"] = now
        self.timings.finished(tracker, "stop", now)
        output = PoolingRequestOutput(tracker.request_id, tracker.prompt_token_ids, update.pooled,
                                      metrics=dict(tracker.metrics))
        self._send(tracker.request_id, output)
        self._forget(tracker.request_id)

    def _report_scheduled(self, new_requests: list[NewRequestData], now: float) -> None:
        for new in new_requests:
            tracker = self._child_owner.get(new.request_id)
            if tracker is not None:
                self.timings.scheduled(tracker, now)

    def _apply_update(self, tracker: RequestTracker, update: RequestUpdate) -> None:
        request = update.request
        child = tracker.child(request.request_id)
        if update.prompt_logprobs is not None:
            tracker.add_prompt_logprobs(*update.prompt_logprobs)
        if not update.new_token_ids:
            return
        stop = tracker.add_tokens(child, update.new_token_ids, update.logprobs,
                                  stop_terminated=request.status == RequestStatus.FINISHED_STOPPED)
        if stop is not None and not request.status.finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            tracker.finish_child(child, "stop", stop)
        elif request.status.finished:
            tracker.finish_child(child, request.status.finish_reason or "stop", request.stop_reason)

    def _send(self, request_id: str, output: RequestOutput | PoolingRequestOutput) -> bool:
        try:
            self._streams[request_id].send_nowait(output)
            return True
        except anyio.BrokenResourceError:
            return False

    def _shutdown(self, failure: BaseException | None) -> None:
        self.dead = True
        if self.eplb is not None:
            self.eplb.stop()
        self._inbox_send.close()
        for rid in list(self._trackers):
            stream = self._streams[rid]
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                stream.send_nowait(dead_error(failure))
            self._forget(rid)
        self._trackers.clear()

    # ---- introspection (for metrics and tests) ---------------------------------------------
    def engine_stats(self) -> list[EngineStats]:
        """`[stats()]`: one engine."""
        return [self.stats()]

    @property
    def pids(self) -> tuple[int, ...]:
        """None: this core runs in this process."""
        return ()

    def stats(self) -> EngineStats:
        """A snapshot of the core now, without the event loop's lag (its owner measures that)."""
        scheduler = self.scheduler
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=self.num_waiting_requests,
            kv_cache_usage=scheduler.kv.usage, prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits, num_preemptions=scheduler.num_preemptions,
            loop_lag=None, loop_lag_max=None, workers_alive=self.executor.workers_alive(),
            eplb=self.eplb.stats() if self.eplb is not None else None,
            mm_encoder_runs=scheduler.num_encoder_runs, encoder_cache_hits=scheduler.encoder_cache.hits,
            encoder_cache_evictions=scheduler.encoder_cache.evictions,
            encoder_cache_usage=scheduler.encoder_cache.usage,
            ec_connector_loads=getattr(scheduler.external, "loads", 0),
            ec_deferrals=getattr(scheduler.external, "deferrals", 0),
            running_lora_adapters=scheduler.lora_adapters(scheduler.running),
            waiting_lora_adapters=scheduler.lora_adapters([*scheduler.waiting, *scheduler.skipped_waiting]),
            max_lora=scheduler.config.max_loras, num_waiting_deferred=scheduler.num_deferred)

    @property
    def num_requests(self) -> int:
        return len(self._trackers)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: queued in the scheduler or not yet applied."""
        return self.scheduler.num_waiting + self.num_pending_messages

    @property
    def num_pending_messages(self) -> int:
        """Messages submitted but not yet applied (they wait for the step in flight)."""
        return self._inbox.statistics().current_buffer_used


def iteration_tokens(updates: list[RequestUpdate]) -> int:
    """vLLM's count of a step (`vllm:iteration_tokens_total`): the tokens it sampled, and the whole
    prompt of each request it began answering (its first token, or its pooled output), so that the
    counts add up to the tokens served, however the prompts were chunked or cached."""
    total = 0
    for update in updates:
        request, sampled = update.request, len(update.new_token_ids)
        first = (sampled and request.num_output_tokens == sampled) or update.pooled is not None
        total += sampled + (request.num_prompt_tokens if first else 0)
    return total


def dead_error(failure: BaseException | None) -> EngineDeadError:
    """What an open request gets when the core stops: closed (no failure), or the failure named."""
    if failure is None or isinstance(failure, anyio.get_cancelled_exc_class()):
        return EngineDeadError("the engine was closed before the request finished")
    error = EngineDeadError(f"the engine failed before the request finished: {failure!r}")
    error.__cause__ = failure
    return error
