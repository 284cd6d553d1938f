"""The continuous-batching scheduler (vLLM v1's design, in plain Python).

Each step has a token budget (`max_num_batched_tokens`). Running requests are
served first, one token each for decodes and a chunk for unfinished prefills;
the rest of the budget admits waiting requests, chunking a long prompt across
steps. When KV blocks run out, the lowest-priority running request is
preempted: its blocks are freed and it is recomputed later from its tokens.

Admission gates let later components (an encoder-cache connector, a remote KV
transfer) defer a waiting request without consuming budget:
- `NOT_YET`: skip it for this step only. It goes to `step_skipped_waiting` and
  is put back at the front of `waiting` after the step, in its original order,
  so everything behind it proceeds meanwhile.
- `BLOCKED`: park it in `skipped_waiting` until the gate says otherwise; the
  scheduler asks again at the start of every step and, once admitted, puts it
  back at the front of `waiting`.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.sched.block_manager import CachedPrefix, KVBlockManager
from engine.sched.encoder_cache import EncoderCacheManager
from engine.sched.output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from engine.sched.queues import make_queue
from engine.sched.request import Request, RequestStatus, check_stop


class Admission(enum.Enum):
    READY = enum.auto()
    NOT_YET = enum.auto()
    BLOCKED = enum.auto()
    FAILED = enum.auto()  # it can never run: finish it, with the gate's `rejection_reason`
    # Not yet, and nothing behind it either: admission stops for this step (head-of-line blocking,
    # what a lookup that waits in place does; kept to measure the difference: `trio-llm bench ec`)
    WAIT = enum.auto()


class AdmissionGate(Protocol):
    def admit(self, request: Request) -> Admission: ...

    def rejection_reason(self, request: Request) -> str: ...


class ExternalEncoderOutputs(Protocol):
    """Encoder outputs that arrive from elsewhere (an EC connector) instead of the encoder."""

    def loaded(self, mm_hash: str) -> Any | None: ...

    def update_state_after_alloc(self, mm_hash: str) -> None: ...

    def build_connector_meta(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Vision models: image rows the encoder may compute in one step, and rows the worker's encoder
    # cache holds (both at least one image's rows; 0 for models without images).
    encoder_budget_rows: int = 0
    encoder_cache_rows: int = 0
    # LoRA: distinct adapters among the running requests at once (--max-loras; 0: no adapters served)
    max_loras: int = 0
    # Steps in flight at once (pipeline stages): each step takes at most its share of the running
    # requests, so the next step has requests of its own to run while this one is in flight.
    micro_batches: int = 1
    # vLLM's async scheduling: a decoding request is scheduled again while its last step is in
    # flight, its input the token that step is sampling (`PLACEHOLDER_TOKEN`; the worker, which
    # runs steps in order, has it by then). The next step is scheduled while this one runs.
    async_scheduling: bool = False
    # vLLM v0's multi-step scheduling (--num-scheduler-steps): while every running request decodes
    # and none waits, one step may run up to this many decodes back to back in the worker (a decode
    # burst, `SchedulerOutput.num_steps`), so the per-step work outside the model (scheduling,
    # publishing, the hand-offs between the loop and the worker) is paid once per burst. 1: never.
    num_scheduler_steps: int = 1


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine core to turn into output."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    pooled: Any = None  # a pooling request's output (it is then finished)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager,
                 gates: Iterable[AdmissionGate] = (), external: ExternalEncoderOutputs | None = None) -> None:
        self.config = config
        self.external = external
        self._rejected: dict[str, str] = {}  # requests a gate failed -> why (the engine core reports them)
        self.num_encoder_runs = 0  # images sent to the encoder (metrics)
        self.kv = block_manager
        self.gates = list(gates)
        self.waiting = make_queue(config.policy)
        self.skipped_waiting = make_queue(config.policy)
        self.step_skipped_waiting: list[Request] = []
        self._deferred_last_step = 0  # waiting requests a gate skipped at the last schedule()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_for_worker: list[str] = []
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_rows)
        self._encoder_budget = 0  # rows left for the encoder in the step being scheduled
        self._encoder_inputs: dict[str, list[int]] = {}
        self.num_preemptions = 0  # total, for metrics
        # Prompt tokens looked up in the prefix cache when a request first ran, and those found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Requests in steps that were scheduled and whose output has not come back (pipeline
        # parallelism and async scheduling keep several steps in flight), with how many steps: none
        # is preempted, nor scheduled again (but for async scheduling's one step ahead), until
        # `update_from_output` has taken its steps' results.
        self.in_flight: collections.Counter[str] = collections.Counter()
        self._ahead: collections.Counter[str] = collections.Counter()  # their tokens, not yet computed
        self._placeholders: collections.Counter[str] = collections.Counter()  # tokens those steps sample

    # ---- intake and abort ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests wherever they are; unknown ids are ignored."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.skipped_waiting:
                self.skipped_waiting.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id, [f.mm_hash for f in request.mm_features])
        del self.requests[request.request_id]
        if request.known_to_worker:
            self._finished_for_worker.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting)

    @property
    def num_deferred(self) -> int:
        """Waiting requests held back by a gate rather than by room (vLLM's "deferred" reason):
        those parked until their gate opens, and those skipped at the last `schedule()` (an
        encoder output on its way, an image that cannot be encoded yet, the adapter limit)."""
        return min(self.num_waiting, len(self.skipped_waiting) + self._deferred_last_step)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.skipped_waiting)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_for_worker)
        self._finished_for_worker = []
        self._readmit_blocked()
        self._encoder_budget = self.config.encoder_budget_rows
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        budget, preempted = self._schedule_running(scheduled, budget)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        for request in reversed(self.step_skipped_waiting):
            self.waiting.prepend(request)
        self._deferred_last_step = len(self.step_skipped_waiting)
        self.step_skipped_waiting.clear()
        out.scheduled = list(scheduled.values())
        if not out.scheduled:  # no step runs: what the workers must hear goes with the next one
            self._finished_for_worker = out.finished_request_ids + self._finished_for_worker
            out.finished_request_ids = []
            return out
        out.num_steps = self._burst(out.scheduled)
        for item in out.scheduled:
            self.in_flight[item.request_id] += 1
            self._ahead[item.request_id] += item.num_tokens
            self._placeholders[item.request_id] += item.sample
        out.encoder_inputs, self._encoder_inputs = self._encoder_inputs, {}
        out.ec_loads = self.external.build_connector_meta() if self.external is not None else {}
        out.freed_encoder_hashes = self.encoder_cache.take_evicted()
        for item in out.scheduled:
            request = self.requests[item.request_id]
            if not request.known_to_worker:
                request.known_to_worker = True
                out.new_requests.append(NewRequestData(
                    request.request_id, list(request.prompt_token_ids), request.sampling_params,
                    request.prompt_embeds, request.pooling_params, request.token_type_ids,
                    list(request.mm_features), request.lora_name, request.max_tokens))
        return out

    def _schedule_running(self, scheduled: dict[str, ScheduledRequest], budget: int) -> tuple[int, bool]:
        preempted_any = False
        i = 0
        share = -(-len(self.running) // self.config.micro_batches)  # this step's part of the running batch
        while i < len(self.running) and budget > 0 and len(scheduled) < share:
            request = self.running[i]
            ahead = self._ahead[request.request_id]  # tokens of its steps in flight
            if ahead and not self._runs_ahead(request):  # its last step's output is not back yet
                i += 1
                continue
            start = request.num_computed_tokens + ahead
            num_new = min(request.num_tokens + self._placeholders[request.request_id] - start, budget)
            num_new, to_encode = self._plan_encoder(request, start, num_new)
            if num_new == 0:  # its next image cannot be encoded this step
                i += 1
                continue
            stuck = False
            while not self.kv.allocate_slots(request, ahead + num_new):
                victim = self._pick_victim()
                if victim is None:  # every other request is in flight: this one waits a step
                    stuck = True
                    break
                if self.running.index(victim) < i:
                    i -= 1  # an already-scheduled request was chosen (priority policy)
                budget += self._preempt(victim, scheduled)
                preempted_any = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; self.running shrank, index i now points at the next one
            if stuck:
                i += 1
                continue
            self._commit_encoder(request, start, num_new, to_encode)
            scheduled[request.request_id] = self._chunk(request, num_new) if not ahead else \
                self._decode_ahead(request, ahead)
            budget -= num_new
            i += 1
        return budget, preempted_any

    def _schedule_waiting(self, scheduled: dict[str, ScheduledRequest], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            verdict, gate = self._ask_gates(request)
            if verdict is Admission.WAIT:
                break
            if verdict is not Admission.READY:
                self.waiting.pop()
                if verdict is Admission.NOT_YET:
                    self.step_skipped_waiting.append(request)
                elif verdict is Admission.FAILED and gate is not None:
                    self._rejected[request.request_id] = gate.rejection_reason(request)
                    request.status = RequestStatus.FINISHED_ABORTED
                    self._release(request)
                else:
                    self.skipped_waiting.add(request)
                continue
            if self._too_many_adapters(request):  # waits for a running adapter's requests to finish
                self.step_skipped_waiting.append(self.waiting.pop())
                continue
            cached = self._cached_prefix(request)
            num_computed = request.num_computed_tokens + (cached.num_blocks * self.kv.block_size if cached else 0)
            num_new = request.num_tokens - num_computed
            # A pooling request is never chunked: its whole prompt is pooled in one step.
            if num_new > budget and (not self.config.enable_chunked_prefill or request.pooling_params is not None):
                break
            num_new, to_encode = self._plan_encoder(request, num_computed, min(num_new, budget))
            if num_new == 0:  # its first image cannot be encoded this step: let those behind it run
                self.step_skipped_waiting.append(self.waiting.pop())
                continue
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            if request.num_computed_tokens == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_computed
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            self._commit_encoder(request, num_computed, num_new, to_encode)
            scheduled[request.request_id] = self._chunk(request, num_new)
            budget -= num_new

    @staticmethod
    def lora_adapters(requests: Iterable[Request]) -> tuple[str, ...]:
        """The distinct LoRA adapters of `requests`, sorted (metrics)."""
        return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))

    def _too_many_adapters(self, request: Request) -> bool:
        """Whether running `request` would put more LoRA adapters in the batch than --max-loras."""
        if request.lora_name is None or not self.config.max_loras:
            return False
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name not in running and len(running) >= self.config.max_loras

    # ---- images ----------------------------------------------------------------------------
    def _plan_encoder(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """How many of `num_new` tokens from `start` can run, and which images must be encoded
        for them: a chunk stops before the first image whose encoding does not fit this step's
        encoder budget or the encoder cache (it waits for a later step)."""
        end, to_encode, rows = start + num_new, [], 0
        reading = {f.mm_hash for f in request.mm_features if f.overlaps(start, end)}  # not evictable now
        space = 0  # cache rows the chunk's new entries need (encoded or loaded)
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, end) or self.encoder_cache.has(feature.mm_hash):
                continue
            encode = self.external is None or self.external.loaded(feature.mm_hash) is None
            if (encode and feature.length > self._encoder_budget - rows) or not self.encoder_cache.can_allocate(
                    space + feature.length, reading):
                end = max(start, feature.offset)
                break
            to_encode.append(index)
            space += feature.length
            rows += feature.length if encode else 0
        return end - start, to_encode

    def _commit_encoder(self, request: Request, start: int, num_new: int, to_encode: list[int]) -> None:
        """Reference the cached images the chunk reads (first, so no allocation evicts them), then
        reserve cache space for the images encoded this step."""
        overlapping = [(i, f) for i, f in enumerate(request.mm_features) if f.overlaps(start, start + num_new)]
        for index, feature in overlapping:
            cached = index not in to_encode or self.encoder_cache.has(feature.mm_hash)
            if cached and request.request_id not in self.encoder_cache.refs.get(feature.mm_hash, ()):
                self.encoder_cache.reference(feature.mm_hash, request.request_id)
        for index, feature in overlapping:
            if index not in to_encode or self.encoder_cache.has(feature.mm_hash):
                continue
            self.encoder_cache.allocate(feature.mm_hash, feature.length, request.request_id)
            if self.external is not None and self.external.loaded(feature.mm_hash) is not None:
                self.external.update_state_after_alloc(feature.mm_hash)  # the connector hands it over
                continue
            self._encoder_budget -= feature.length
            self.num_encoder_runs += 1
            self._encoder_inputs.setdefault(request.request_id, []).append(index)

    def _cached_prefix(self, request: Request) -> CachedPrefix | None:
        # Prompt logprobs and pooling need every prompt position computed.
        if (request.num_computed_tokens or request.sampling_params.prompt_logprobs is not None
                or request.pooling_params is not None):
            return None
        return self.kv.find_cached_prefix(request)

    def _chunk(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_tables=self.kv.block_tables(request.request_id),
            sample=end == request.num_tokens,
        )

    def _runs_ahead(self, request: Request) -> bool:
        """Async scheduling: whether a request in flight decodes one step ahead now. Its one step in
        flight samples the token this step takes, it has no prompt left, and that token will not
        end it by length (an end by EOS or a stop string is seen later: the extra token is dropped)."""
        rid = request.request_id
        return (self.config.async_scheduling and self.in_flight[rid] == 1 and self._placeholders[rid] == 1
                and request.pooling_params is None
                and request.num_computed_tokens + self._ahead[rid] == request.num_tokens
                and request.num_output_tokens + 1 < request.max_tokens
                and request.num_tokens + 1 < self.config.max_model_len)

    def _decode_ahead(self, request: Request, ahead: int) -> ScheduledRequest:
        """One decode after the tokens in flight, its input the token the step in flight samples."""
        return ScheduledRequest(request.request_id, [PLACEHOLDER_TOKEN], request.num_computed_tokens + ahead,
                                self.kv.block_tables(request.request_id), sample=True)

    def _burst(self, scheduled: list[ScheduledRequest]) -> int:
        """How many decodes this step runs back to back (`num_scheduler_steps` at most; 1 unless
        every scheduled request is a plain decode, nothing waits and nothing is in flight). None
        may pass its `max_tokens` or the context length inside the burst; room in the KV cache for
        every decode is taken now, for every request at once: the burst is shortened (halved) until
        it all fits, never taken for some requests and not others, which would strand blocks with
        them that the rest then lack. (An EOS or a stop string inside a burst ends the request
        there; the decodes after it are dropped.)"""
        limit = self.config.num_scheduler_steps
        if limit <= 1 or self.waiting or self.skipped_waiting or self.in_flight:
            return 1
        requests = [self.requests[item.request_id] for item in scheduled]
        for item, request in zip(scheduled, requests, strict=True):
            if item.num_tokens != 1 or not item.sample or not self._bursts(request):
                return 1
            limit = min(limit, request.max_tokens - request.num_output_tokens,
                        self.config.max_model_len - request.num_tokens)
        while limit > 1 and not self.kv.room_for_all(requests, limit):
            limit //= 2
        if limit > 1 and all(self.kv.allocate_slots(request, limit) for request in requests):
            for item, request in zip(scheduled, requests, strict=True):
                item.block_tables = self.kv.block_tables(request.request_id)
            return limit
        return 1

    @staticmethod
    def _bursts(request: Request) -> bool:
        """Whether a decoding request may run in a burst: not one whose grammar must see each token
        before the next is sampled (a burst would sample past its end), not a pooling request."""
        return request.pooling_params is None and request.sampling_params.structured_outputs is None

    def _ask_gates(self, request: Request) -> tuple[Admission, AdmissionGate | None]:
        for gate in self.gates:
            verdict = gate.admit(request)
            if verdict is not Admission.READY:
                return verdict, gate
        return Admission.READY, None

    def take_rejected(self) -> dict[str, str]:
        """Requests a gate failed since the last call, and why: they are finished already."""
        rejected, self._rejected = self._rejected, {}
        return rejected

    def _readmit_blocked(self) -> None:
        ready = [r for r in self.skipped_waiting if self._ask_gates(r)[0] is not Admission.BLOCKED]
        for request in reversed(ready):
            self.skipped_waiting.remove(request)
            self.waiting.prepend(request)

    def _pick_victim(self) -> Request | None:
        """The running request to preempt (never one in flight: its step still uses its blocks);
        None when every running request is."""
        candidates = [r for r in self.running if not self.in_flight[r.request_id]]
        if not candidates:
            return None
        if self.config.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free the request's blocks and send it back to waiting; returns budget handed back."""
        self.running.remove(request)
        self.kv.free(request)
        # An image it was to encode this step is still encoded (the worker keeps the request's
        # pixels): the cache entry reserved for it stays valid, and freeable.
        self.encoder_cache.release_all(request.request_id, [f.mm_hash for f in request.mm_features])
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        undone = scheduled.pop(request.request_id, None)
        return undone.num_tokens if undone else 0

    # ---- after the step ------------------------------------------------------------------
    def _finish_pooled(self, request: Request, update: RequestUpdate, result: ModelRunnerOutput) -> None:
        """A pooling request is done after the step that computed its prompt; its blocks go now."""
        update.pooled = result.pooled.get(request.request_id)
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(request)
        self._release(request)
        update.finished = True

    def _landed(self, item: ScheduledRequest) -> None:
        """A step's output is back: its share is no longer in flight."""
        rid = item.request_id
        for counts, done in ((self.in_flight, 1), (self._ahead, item.num_tokens), (self._placeholders, item.sample)):
            counts[rid] -= done
            if counts[rid] <= 0:
                del counts[rid]

    def update_from_output(self, sched_out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance every scheduled request by what the step computed and sampled."""
        for item in sched_out.scheduled:
            self._landed(item)
        return self._take_output(sched_out.scheduled, sched_out.num_steps, result)

    def is_running(self, request_id: str) -> bool:
        """Whether the request is scheduled on (not finished, aborted or preempted)."""
        request = self.requests.get(request_id)
        return request is not None and request.status == RequestStatus.RUNNING

    def update_from_burst_step(self, sched_out: SchedulerOutput, step: ModelRunnerOutput,
                               first: bool) -> list[RequestUpdate]:
        """One step of a decode burst whose tokens come back step by step while it runs (the
        in-process executor streams them, `StreamedBurst`): each advances its requests by one
        position, as a one-step output would. The burst lands with its `first` step: nothing is
        scheduled until it has ended, and a burst that ends early keeps the blocks it took."""
        if first:
            for item in sched_out.scheduled:
                self._landed(item)
        return self._take_output(sched_out.scheduled, 1, step)

    def _take_output(self, scheduled: list[ScheduledRequest], num_steps: int,
                     result: ModelRunnerOutput) -> list[RequestUpdate]:
        """The step's tokens into its requests; `num_steps` > 1: a burst's steps, all in `result`."""
        updates = []
        for item in scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_computed_blocks(request)
            for feature in request.mm_features:
                if feature.end <= request.num_computed_tokens:  # its rows are in the KV cache now
                    self.encoder_cache.release(feature.mm_hash, request.request_id)
            update = RequestUpdate(request, prompt_logprobs=result.prompt_logprobs.get(item.request_id))
            if request.pooling_params is not None:
                self._finish_pooled(request, update, result)
                updates.append(update)
                continue
            self._take_tokens(request, update, result)
            if num_steps > 1 and not update.finished:  # the burst's later steps computed its tokens
                request.num_computed_tokens += num_steps - 1
                self.kv.cache_computed_blocks(request)
            if update.new_token_ids or update.prompt_logprobs:
                updates.append(update)
        return updates

    def _take_tokens(self, request: Request, update: RequestUpdate, result: ModelRunnerOutput) -> None:
        """The tokens the step sampled for `request`, in order, up to the first that ends it."""
        rid = request.request_id
        logprobs = result.logprobs.get(rid)
        for i, token in enumerate(result.sampled_token_ids.get(rid, ())):
            request.append_output_token(token)
            update.new_token_ids.append(token)
            if logprobs is not None:
                update.logprobs.append(logprobs[i])
            if check_stop(request, self.config.max_model_len):
                self.running.remove(request)
                self._release(request)
                update.finished = True
                return
