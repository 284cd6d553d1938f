"""One step of the model: flat batch in, one sampled token per finishing chunk out.

The runner keeps what it needs per request between steps (prompt, sampling
params, its own seeded generator, tokens sampled so far for penalties). The
scheduler says when a request is new (`new_requests`) and when it is gone
(`finished_request_ids`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.core_request import PromptEmbeds
from engine.lora.serving import LoRAServing, lora_batch
from engine.mm_features import ImageFeature
from engine.model_info import PoolerConfig
from engine.models.attention import SequenceChunk, build_metadata
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.models.parallel import PipelineStage
from engine.models.pooler import finish, pool
from engine.models.vision import LlavaVision
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sched.output import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    StepSink,
    TokenLogprobs,
)
from engine.worker.cuda_graphs import CapturedDecode
from engine.worker.decode_graphs import DecodeGraphs
from engine.worker.grammar_masks import Budget, GrammarMasks
from engine.worker.lean_burst import LeanBurst
from engine.worker.sampler import (
    DeviceSample,
    HostSample,
    SamplingRow,
    chosen_from_logits_alone,
    sample_on_device,
    top_logprobs,
)
from engine.worker.step_graph import StepGraph
from engine.worker.transfers import to_device


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_embeds: PromptEmbeds | None = None
    pooling: PoolingParams | None = None
    output_token_ids: list[int] = field(default_factory=list)
    mm_features: list[ImageFeature] = field(default_factory=list)  # with pixel values, kept for re-encoding
    matcher: Any = None  # an llguidance matcher: the request's structured outputs
    grammar_active: bool = True  # False while a reasoning model is still reasoning
    lora_name: str | None = None  # the LoRA adapter this request runs with (None: the base model)
    budget: Budget | None = None  # with a matcher and a known max_tokens: its output budget

    def grammar_budget(self) -> Budget | None:
        """The budget as of this step (the tokens still to sample, this one included)."""
        if self.budget is not None:
            self.budget.remaining = self.budget.max_tokens - len(self.output_token_ids)
        return self.budget

    def advance_grammar(self, token: int) -> None:
        """After a sampled token: the matcher consumes it, or (still reasoning) the grammar starts
        once the output ends with the reasoning's end."""
        spec = self.params.structured_outputs
        if self.grammar_active:
            GrammarMasks.accept(self.matcher, token)
        elif spec is not None and spec.reasoning_end and \
                tuple(self.output_token_ids[-len(spec.reasoning_end):]) == spec.reasoning_end:
            self.grammar_active = True

    def sampling_row(self) -> SamplingRow:
        """What the sampler reads of this request (its output list itself: later tokens show)."""
        return SamplingRow(self.params, self.generator, self.penalty_prompt_ids, self.output_token_ids)

    @property
    def penalty_prompt_ids(self) -> list[int]:
        """Prompt tokens the penalties count: none for an embeddings prompt (its ids are placeholders)."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids


class StepSample:
    """One step's sample as it travels (a `PendingSample`): the tokens stay on the device, where
    the next step's placeholders read them (async scheduling), while they are copied to the host
    for the engine core and for the runner's own request states."""

    def __init__(self, groups: list[tuple[list[RequestState], list[str], DeviceSample]], copy_stream: Any) -> None:
        self.states = [state for group_states, _, _ in groups for state in group_states]
        self.request_ids = [rid for _, ids, _ in groups for rid in ids]
        samples = [sample for _, _, sample in groups]
        self.on_device = samples[0].token_ids if len(samples) == 1 else torch.cat([s.token_ids for s in samples])
        self.row = {rid: i for i, rid in enumerate(self.request_ids)}
        self._host: list[tuple[list[str], HostSample]] = [(ids, s.read_back(copy_stream)) for _, ids, s in groups]
        self.stream = self._host[0][1].copy.stream
        self._read: dict[str, tuple[int, TokenLogprobs | None]] | None = None

    def read(self) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Request id -> (token, logprobs); waits for the copy to the host if it is not done."""
        if self._read is None:
            read: dict[str, tuple[int, TokenLogprobs | None]] = {}
            for ids, host in self._host:
                result = host.result()
                read.update(zip(ids, zip(result.token_ids, result.logprobs, strict=True), strict=True))
            self._read = read
        return self._read

    def read_all(self) -> dict[str, list[tuple[int, TokenLogprobs | None]]]:
        """`read()`, as `PendingSample` gives it: a list of one per request."""
        return {rid: [sampled] for rid, sampled in self.read().items()}


class BurstSample:
    """A decode burst's samples (`PendingSample`): each request's tokens, step after step. The
    copies to the host run in order on one stream, so the last one's event marks them all done."""

    def __init__(self, samples: list[StepSample]) -> None:
        self.samples = samples
        self.stream = samples[-1].stream

    def read_all(self) -> dict[str, list[tuple[int, TokenLogprobs | None]]]:
        tokens: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}
        for sample in self.samples:
            for rid, sampled in sample.read().items():
                tokens.setdefault(rid, []).append(sampled)
        return tokens


def step_tokens(sample: StepSample | None) -> ModelRunnerOutput:
    """One step's tokens (and logprobs where asked) as an output of their own: a streamed burst's."""
    out = ModelRunnerOutput()
    if sample is not None:
        for rid, (token, logprobs) in sample.read().items():
            out.sampled_token_ids[rid] = [token]
            if logprobs is not None:
                out.logprobs[rid] = [logprobs]
    return out


@dataclass(frozen=True)
class RankRole:
    """Where a rank stands. Under tensor parallelism every rank computes the logits (a
    collective); only the driver (the first rank of the last stage) samples and reports, the
    others return an empty output. A pipeline stage after the first takes its input rows from
    the one before; a stage before the last hands its output on and samples nothing."""

    is_driver: bool = True
    stage: PipelineStage = PipelineStage()
    tp_rank: int = 0  # its place in its stage


@dataclass(frozen=True)
class RunnerGraphs:
    """The graphs steps run on (None: eager): the decodes on the compiled graph (CPU) or the
    captured ones (CUDA), the other steps on the compiled step graph (engine/worker/graph_plan.py)."""

    decode: DecodeGraphs | CapturedDecode | None = None
    step: StepGraph | None = None


@dataclass(frozen=True)
class RunnerFeatures:
    """What requests may ask of this rank beyond plain text."""

    pooler: PoolerConfig = PoolerConfig()
    report_expert_load: bool = False  # MoE: tokens routed to each expert, for EPLB
    vision: LlavaVision | None = None  # a vision-language model's tower and projector
    save_encoder_output: Callable[[str, torch.Tensor], Any] | None = None  # an EC producer's store (driver only)
    grammar: GrammarMasks | None = None  # structured outputs (matchers live on the driver, which samples)
    lora: LoRAServing | None = None  # the LoRA adapters served


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[KVCache], block_size: int,
                 device: torch.device, seed: int, *, num_blocks: int | None = None, role: RankRole = RankRole(),
                 graphs: RunnerGraphs = RunnerGraphs(), features: RunnerFeatures = RunnerFeatures()) -> None:
        """`num_blocks`: the scheduler's blocks (default: all the cache holds)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = num_blocks if num_blocks is not None else \
            (kv_caches[0][0].shape[0] // block_size if kv_caches else 0)
        self.decode_graphs = graphs.decode
        self.step_graph = graphs.step
        self.lora = features.lora
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # The last step's sample until its tokens are in the request states (`_apply_in_flight`);
        # on CUDA it is copied to the host on a side stream, so the next step's kernels do not
        # queue behind the copy.
        self._in_flight: StepSample | None = None
        self._copy_stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
                             if torch.device(device).type == "cuda" else None)
        self.is_driver = role.is_driver
        self.pooler = features.pooler
        self.report_expert_load = features.report_expert_load and bool(model.moe_layers)
        self.vision = features.vision
        # mm_hash -> encoder output rows [rows, hidden]; the scheduler decides what stays (its
        # EncoderCacheManager mirrors this) and sends evictions in `freed_encoder_hashes`.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded = 0  # images run through the vision encoder (metrics, tests)
        self.lean_burst_steps = 0  # burst steps run on `LeanBurst` (tests)
        self.save_encoder_output = features.save_encoder_output
        self.grammar = features.grammar
        self.stage = role.stage
        self.tp_rank = role.tp_rank

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, on_step: StepSink | None = None) -> ModelRunnerOutput:
        """One step (a decode burst's steps, `SchedulerOutput.num_steps`). A request whose own
        inputs fail it (while its state is set up, or while it is sampled) is left out and reported
        in `failed`; only a failure of the forward pass itself, which no request can be blamed for,
        raises.

        `on_step` (a burst only): each step's tokens are handed to it as soon as they are sampled,
        one `ModelRunnerOutput` per step, and the burst goes on while it returns True. The result
        then carries no tokens, only what failed and how many steps ran (`steps_run`)."""
        out = self._execute_one(sched_out)
        if sched_out.num_steps > 1:
            self._run_burst(sched_out, out, on_step)
        return out

    def _run_burst(self, sched_out: SchedulerOutput, out: ModelRunnerOutput, on_step: StepSink | None) -> None:
        """The rest of a decode burst after its first step (`out`): the same decodes again, one
        position on, each input the token the step before sampled, read on the device as async
        scheduling's placeholders are (`_fill_placeholders`). `out` then carries every step's sample,
        or, with `on_step`, none: each went to `on_step` as it was sampled."""
        samples = [out.pending] if isinstance(out.pending, StepSample) else []
        keep_going = on_step is None or on_step(step_tokens(samples[-1] if samples else None))
        if on_step is not None and keep_going and self._run_lean_burst(sched_out, out, on_step):
            return
        for i in range(1, sched_out.num_steps):
            live = [s for s in sched_out.scheduled if s.request_id not in out.failed]
            if not live or not keep_going:
                break
            step = self._execute_one(SchedulerOutput(scheduled=[
                ScheduledRequest(s.request_id, [PLACEHOLDER_TOKEN], s.start_position + i, s.block_tables, sample=True)
                for s in live]))
            out.failed.update(step.failed)
            out.steps_run += 1
            sample = step.pending if isinstance(step.pending, StepSample) else None
            if sample is not None:
                samples.append(sample)
            if on_step is not None:
                keep_going = on_step(step_tokens(sample))
        if on_step is not None:
            out.pending = None
        elif samples:
            out.pending = BurstSample(samples)

    def _run_lean_burst(self, sched_out: SchedulerOutput, out: ModelRunnerOutput, on_step: StepSink) -> bool:
        """A streamed burst's later steps on `LeanBurst`, where every request's token comes from its
        logits alone (`_lean_burst`); False (nothing run) where one's does not."""
        burst = self._lean_burst(sched_out, out)
        if burst is None:
            return False
        states = [self.requests[s.request_id] for s in sched_out.scheduled]
        ids = [s.request_id for s in sched_out.scheduled]
        out.pending = None  # each step's tokens go to `on_step`
        for _ in range(1, sched_out.num_steps):
            tokens = burst.step()
            self.lean_burst_steps += 1
            for state, token in zip(states, tokens, strict=True):
                state.output_token_ids.append(token)
            out.steps_run += 1
            if not on_step(ModelRunnerOutput(sampled_token_ids={rid: [t] for rid, t in zip(ids, tokens, strict=True)})):
                break
        return True

    def _lean_burst(self, sched_out: SchedulerOutput, out: ModelRunnerOutput) -> LeanBurst | None:
        """The burst's later steps as a `LeanBurst`, or None where the general step is needed: a
        runner that cannot (`_runs_lean_bursts`), a request that failed or was not sampled, or one
        that wants logprobs, penalties, a bias or a mask (`chosen_from_logits_alone`), follows a
        grammar or pools. The first step's sample then goes into the request states (the burst's
        other tokens go in as they are sampled)."""
        graphs, scheduled = self.decode_graphs, sched_out.scheduled
        if (not isinstance(graphs, DecodeGraphs) or not self._runs_lean_bursts(graphs, len(scheduled)) or out.failed
                or not isinstance(out.pending, StepSample) or len(out.pending.request_ids) != len(scheduled)
                or not all(s.num_tokens == 1 and s.sample for s in scheduled)):
            return None
        states = [state for s in scheduled if (state := self.requests.get(s.request_id)) is not None
                  and state.matcher is None and state.pooling is None
                  and chosen_from_logits_alone(state.params, len(state.output_token_ids) + 1)]
        if len(states) != len(scheduled):
            return None
        self._apply_in_flight()  # the first step's tokens
        return LeanBurst(graphs, self.model, [state.output_token_ids[-1] for state in states],
                         [s.start_position + 1 for s in scheduled], [s.block_tables[0] for s in scheduled],
                         self.block_size, [state.sampling_row() for state in states], self.generator)

    def _runs_lean_bursts(self, graphs: DecodeGraphs, count: int) -> bool:
        """Whether this runner can run a burst of `count` decodes on `LeanBurst`: the compiled
        graph on the CPU, one rank (the driver of one stage), one KV cache group, no LoRA
        adapters and no expert-load reports."""
        return (torch.device(self.device).type == "cpu" and self.is_driver and self.stage.is_first
                and self.stage.is_last and not self.report_expert_load and self.lora is None
                and graphs.num_kv_groups == 1 and graphs.takes(count, 0))

    def _execute_one(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        self._update_states(sched_out, out.failed)
        for mm_hash in sched_out.freed_encoder_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for mm_hash, rows in sched_out.ec_loads.items():
            self.encoder_cache[mm_hash] = rows.to(self.device, self.model.dtype)
        self._run_encoder(sched_out.encoder_inputs)
        if sched_out.is_empty:
            return out
        # Decodes first: attention then treats them as one unpadded group.
        batch = sorted((s for s in sched_out.scheduled if s.request_id in self.requests),
                       key=lambda s: s.num_tokens != 1)
        batch, from_device = self._fill_placeholders(batch, out.failed)
        if not batch:
            return out
        hidden = self._forward(batch, from_device)
        # This step's work is queued: now the host may wait for the last step's tokens (at once on
        # CPU; on CUDA while the device runs on), which the penalties and grammars below read.
        self._apply_in_flight()
        if not self.stage.is_last:
            self.stage.send_to_next_stage(hidden, self.tp_rank)  # the next stage's input rows
            return out
        if self.report_expert_load and self.is_driver:
            # A nested list: pickling it round trip costs ~1 us, a tensor's ~130 us (measured).
            out.expert_load = self.model.take_expert_load().tolist()
        self._sample(batch, hidden, out)
        self._prompt_logprobs(batch, hidden, out)
        self._pool(batch, hidden, out)
        return out

    def _fill_placeholders(self, batch: list[ScheduledRequest],
                           failed: dict[str, str]) -> tuple[list[ScheduledRequest], dict[int, int]]:
        """Async scheduling: a decode scheduled while the step before it was in flight carries
        `PLACEHOLDER_TOKEN`. That step ran here first (steps run in order), so the token is the
        request's output at that position: from its state if it is there already, else from the
        last step's sample on the device, read there by `_forward` (the second result: batch index
        -> row of the sample). A request whose step sampled nothing (it failed) fails."""
        filled: list[ScheduledRequest] = []
        from_device: dict[int, int] = {}
        in_flight = self._in_flight
        for item in batch:
            if item.token_ids != [PLACEHOLDER_TOKEN]:
                filled.append(item)
                continue
            state = self.requests[item.request_id]
            index = item.start_position - len(state.prompt_token_ids)
            if 0 <= index < len(state.output_token_ids):
                filled.append(replace(item, token_ids=[state.output_token_ids[index]]))
            elif in_flight is not None and index == len(state.output_token_ids) and item.request_id in in_flight.row:
                from_device[len(filled)] = in_flight.row[item.request_id]
                filled.append(item)
            else:
                failed[item.request_id] = "the step before this one sampled no token for it"
        return filled, from_device

    def _apply_in_flight(self) -> None:
        """The last step's tokens into the states of its requests (those still here, and not
        replaced since), with their grammars advanced. Waits for the sample's copy to the host."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        read = step.read()
        for rid, state in zip(step.request_ids, step.states, strict=True):
            if self.requests.get(rid) is not state:
                continue
            token = read[rid][0]
            state.output_token_ids.append(token)
            if state.matcher is not None:
                state.advance_grammar(token)

    def _pool(self, batch: list[ScheduledRequest], hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Pooling requests (the decoder as an embedder) are scheduled whole: pool their rows."""
        offset = 0
        for item in batch:
            params = self.requests[item.request_id].pooling
            rows = hidden[offset:offset + item.num_tokens]
            offset += item.num_tokens
            if params is None or not self.is_driver:
                continue
            if params.task == "token_embed":
                out.pooled[item.request_id] = finish(rows, params, self.pooler).cpu()
            else:
                out.pooled[item.request_id] = finish(pool(rows, self.pooler.pooling), params, self.pooler).cpu()

    def _update_states(self, sched_out: SchedulerOutput, failed: dict[str, str]) -> None:
        for rid in sched_out.finished_request_ids:
            self.requests.pop(rid, None)
        for new in sched_out.new_requests:
            try:
                self.requests[new.request_id] = self._new_state(new)
            except Exception as exc:  # this request's inputs: it alone fails
                failed[new.request_id] = f"{type(exc).__name__}: {exc}"

    def _new_state(self, new: NewRequestData) -> RequestState:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.sampling_params.seed)
        embeds = None if new.prompt_embeds is None else new.prompt_embeds.to(self.device, self.model.dtype)
        if new.mm_features and self.vision is None:
            raise ValueError("this model does not take images")
        matcher = None
        spec = new.sampling_params.structured_outputs
        if spec is not None and self.is_driver:
            if self.grammar is None or spec.compiled is None:
                raise ValueError("structured outputs need a compiled grammar")
            eos = new.sampling_params.eos_token_ids
            matcher = self.grammar.matcher(spec.compiled, eos[0] if eos else None)
        if new.lora_name is not None:
            if self.lora is None:
                raise ValueError("this engine serves no LoRA adapters (--enable-lora)")
            self.lora.hold(new.lora_name)  # in memory (read again if evicted): a failure fails this request
        budget = None
        if matcher is not None and new.max_tokens is not None:
            eos = new.sampling_params.eos_token_ids
            budget = Budget(new.max_tokens, eos[0] if eos else None)
        return RequestState(new.prompt_token_ids, new.sampling_params, generator, embeds, new.pooling_params,
                            mm_features=list(new.mm_features), matcher=matcher,
                            grammar_active=spec is None or spec.starts_active(new.prompt_token_ids),
                            lora_name=new.lora_name, budget=budget)

    def _run_encoder(self, encoder_inputs: dict[str, list[int]]) -> None:
        """Encode this step's images (all in one batch) into the encoder cache."""
        features = [self.requests[rid].mm_features[i] for rid, indices in encoder_inputs.items()
                    if rid in self.requests for i in indices]
        features = [f for f in features if f.mm_hash not in self.encoder_cache]
        if not features:
            return
        assert self.vision is not None, "the scheduler sends images only for vision models"
        pixels = torch.stack([f.pixel_values for f in features]).to(self.device)
        rows = self.vision.encode(pixels)
        for feature, feature_rows in zip(features, rows, strict=True):
            self.encoder_cache[feature.mm_hash] = feature_rows
            if self.save_encoder_output is not None and self.is_driver:
                self.save_encoder_output(feature.mm_hash, feature_rows)
        self.num_encoded += len(features)

    def _forward(self, batch: list[ScheduledRequest], from_device: dict[int, int]) -> torch.Tensor:
        """`from_device`: batch index -> the row of the last step's sample that is its one input
        token (`_fill_placeholders`)."""
        positions: list[int] = []
        for item in batch:
            positions.extend(range(item.start_position, item.start_position + item.num_tokens))
        input_ids = self._input_ids(batch, from_device)
        pos = to_device(positions, torch.long, self.device)
        if not self.stage.is_first:  # the previous stage's output rows (pipeline stages run eagerly)
            rows = self.stage.receive_from_previous_stage(len(positions), self.model.config.hidden_size,
                                                          self.model.dtype, self.device, self.tp_rank)
            return self._forward_eager(batch, rows, pos)
        embeds = self._embed(batch, input_ids)
        graphs = self.decode_graphs
        num_decodes = next((i for i, s in enumerate(batch) if s.num_tokens != 1), len(batch))  # decodes come first
        blocks = max((s.start_position // self.block_size + 1 for s in batch[:num_decodes]), default=0)
        if graphs is None or not num_decodes or not graphs.takes(num_decodes, blocks):
            return self._forward_eager(batch, embeds, pos)
        with self._adapters(batch[:num_decodes]):
            decoded = self._decode_compiled(graphs, batch[:num_decodes], embeds[:num_decodes], pos[:num_decodes])
        if num_decodes == len(batch):
            return decoded
        # A mixed step: the decodes on their graph, the prompt chunks on theirs. Two calls on disjoint
        # sequences (each writes and reads only its own KV blocks); under load most steps are mixed,
        # and running them all on one cost the decode graph its gain (docs/benchmarks.md).
        prompts = self._forward_eager(batch[num_decodes:], embeds[num_decodes:], pos[num_decodes:])
        return torch.cat([decoded, prompts])

    def _input_ids(self, batch: list[ScheduledRequest], from_device: dict[int, int]) -> torch.Tensor:
        """The flat batch's input tokens on the device, the placeholders' read from the last step's
        sample (`from_device`). A burst's later steps are all placeholders, each the sample's row of
        its own index: the sample itself is then the input, with no copy or gather (three host
        lists and two indexing kernels less a step: `_forward`'s own time 33-36 -> 13 us a step
        under cProfile on the small Llama, docs/benchmarks.md)."""
        in_flight = self._in_flight
        if (in_flight is not None and len(from_device) == len(batch) == in_flight.on_device.shape[0]
                and all(i == row for i, row in from_device.items())):
            return in_flight.on_device
        token_ids: list[int] = []
        flat_index = {}
        for index, item in enumerate(batch):
            flat_index[index] = len(token_ids)
            token_ids.extend(item.token_ids if index not in from_device else [0])
        input_ids = to_device(token_ids, torch.long, self.device)
        if from_device:
            assert in_flight is not None
            flat = to_device([flat_index[i] for i in from_device], torch.long, self.device)
            input_ids[flat] = in_flight.on_device[to_device(list(from_device.values()), torch.long, self.device)]
        return input_ids

    def _adapters(self, batch: list[ScheduledRequest]) -> contextlib.AbstractContextManager[None]:
        """While one forward call over `batch` runs: which of its rows run which LoRA adapter."""
        if self.lora is None:
            return contextlib.nullcontext()
        names = [self.requests[s.request_id].lora_name for s in batch]
        return lora_batch(self.lora.batch(names, [s.num_tokens for s in batch], self.device))

    def _forward_eager(self, batch: list[ScheduledRequest], embeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Any batch, on the step graph if there is one (attention eager inside it), else eager."""
        groups = [[SequenceChunk(s.start_position, s.num_tokens, s.block_tables[g]) for s in batch]
                  for g in range(len(batch[0].block_tables))]  # per KV cache group (engine/kv_groups.py)
        meta = build_metadata(groups[0], self.block_size, self.device, self.model.dtype, groups[1:])
        with self._adapters(batch):
            if self.step_graph is not None and self.step_graph.takes(embeds.shape[0]):
                return self.step_graph.run(embeds, pos, meta)
            hidden: torch.Tensor = self.model(embeds, pos, self.kv_caches, meta)
        return hidden

    def _decode_compiled(self, graphs: DecodeGraphs | CapturedDecode, batch: list[ScheduledRequest],
                         embeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The step's decodes on the compiled graph."""
        size = self.block_size
        lengths = [s.start_position + 1 for s in batch]
        groups: list[tuple[list[int], list[list[int]]]] = []  # per KV cache group: slots and tables
        for g in range(len(batch[0].block_tables)):
            slots, tables = [], []
            for s in batch:
                p, ids = s.start_position, s.block_tables[g]
                slots.append(ids[p // size] * size + p % size)
                tables.append(ids[:p // size + 1])
            groups.append((slots, tables))
        (slots, tables), *others = groups
        return graphs.run(embeds, pos, slots, lengths, tables, other_groups=others)

    def _embed(self, batch: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings for the flat batch, with prompt-embeddings rows written over the
        placeholder positions of embeddings prompts (only their prompt part; generated tokens
        are ordinary tokens)."""
        hidden = self.model.embed(input_ids)
        offset = 0
        for item in batch:
            state = self.requests[item.request_id]
            embeds = state.prompt_embeds
            start, end = item.start_position, item.start_position + item.num_tokens
            if embeds is not None:  # given rows over their placeholder positions
                for lo, hi, row in embeds.overlaps(start, end):
                    hidden[offset + lo - start:offset + hi - start] = embeds.rows[row:row + hi - lo]
            for feature in state.mm_features:  # image rows over their placeholders
                if feature.overlaps(start, end):
                    lo, hi = max(start, feature.offset), min(end, feature.end)
                    rows = self.encoder_cache[feature.mm_hash]
                    hidden[offset + lo - start:offset + hi - start] = rows[lo - feature.offset:hi - feature.offset]
            offset += item.num_tokens
        return hidden

    def _sample(self, batch: list[ScheduledRequest], hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Sample on the device and start the copy to the host: `out.pending` until resolved; the
        states take the tokens at the next step (`_apply_in_flight`)."""
        last_rows, states, ids = [], [], []
        offset = 0
        for item in batch:
            offset += item.num_tokens
            if item.sample and self.requests[item.request_id].pooling is None:
                last_rows.append(offset - 1)
                states.append(self.requests[item.request_id])
                ids.append(item.request_id)
        if not ids:
            return
        # A batch of decodes samples every row: no gather (on CUDA, a host copy and a kernel less a step).
        last = hidden if len(last_rows) == hidden.shape[0] else hidden[to_device(last_rows, torch.long, self.device)]
        logits = (self.decode_graphs or self.model).compute_logits(last)
        if not self.is_driver:
            return
        rows = [s.sampling_row() for s in states]
        if self.grammar is not None:
            self.grammar.apply(logits, [s.matcher if s.grammar_active else None for s in states],
                               [s.grammar_budget() for s in states])
        try:
            groups = [(states, ids, sample_on_device(logits, rows, self.generator))]
        except Exception:  # some row broke the batch: sample row by row and fail only the culprits
            groups = []
            for i, (rid, row) in enumerate(zip(ids, rows, strict=True)):
                try:
                    groups.append(([states[i]], [rid], sample_on_device(logits[i:i + 1], [row], self.generator)))
                except Exception as exc:
                    out.failed[rid] = f"{type(exc).__name__}: {exc}"
        if groups:
            self._in_flight = StepSample(groups, self._copy_stream)
            out.pending = self._in_flight

    def _prompt_logprobs(self, batch: list[ScheduledRequest], hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """For each prompt position p in the chunk, the logprob of prompt token p + 1."""
        offset = 0
        for item in batch:
            state = self.requests[item.request_id]
            num_prompt = len(state.prompt_token_ids)
            start, end = item.start_position, item.start_position + item.num_tokens
            last = min(end, num_prompt - 1)  # positions p with a next prompt token
            if state.params.prompt_logprobs is not None and start < last:
                rows = hidden[offset:offset + (last - start)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                if self.is_driver:
                    entries: list[TokenLogprobs] = [
                        top_logprobs(logprobs[j], state.prompt_token_ids[start + j + 1],
                                     state.params.prompt_logprobs)
                        for j in range(last - start)
                    ]
                    out.prompt_logprobs[item.request_id] = (start, entries)
            offset += item.num_tokens
