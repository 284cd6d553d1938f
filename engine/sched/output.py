"""What crosses the scheduler/worker boundary each step.

Plain picklable data, so the same structures go to an in-process worker or,
later, over a socket to a worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the worker keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt_embeds: Any = None  # a (num prompt tokens, hidden) tensor replacing the prompt's token embeddings
    pooling_params: Any = None  # a PoolingParams: pool the prompt's hidden states instead of sampling
    token_type_ids: list[int] | None = None  # segment ids (BERT sentence pairs)
    mm_features: list[Any] = field(default_factory=list)  # ImageFeatures, with their pixel values
    lora_name: str | None = None  # the LoRA adapter the request runs with (None: the base model)
    max_tokens: int | None = None  # the output tokens it may generate, resolved (constrained outputs plan to it)


# Async scheduling: the input token of a decode scheduled while the step before it is in flight, the
# token that step samples. The worker, which runs steps in order, puts it in.
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions `start_position...`."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_tables: tuple[list[int], ...]  # its block ids in each KV cache group (engine/kv_groups.py)
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the worker drops their state
    eplb_commit: Any = None  # a staged LayerPlan: the worker adopts it before this step's forward pass
    # request id -> indices of its mm_features to run through the encoder this step (not cached)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    freed_encoder_hashes: list[str] = field(default_factory=list)  # evicted from the encoder cache
    ec_loads: dict[str, Any] = field(default_factory=dict)  # mm_hash -> encoder output loaded by the EC connector
    # A decode burst (vLLM v0's multi-step scheduling, `num_scheduler_steps`): every scheduled
    # request is a one-token decode, and the worker runs `num_steps` decodes back to back, each
    # one's input the token the one before sampled; the scheduler made room for all of them. The
    # step's output has up to `num_steps` tokens per request.
    num_steps: int = 1

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# Logprobs of one position as returned by the worker: (token ids, logprobs, ranks),
# the chosen token first, then the top-N candidates.
TokenLogprobs = tuple[list[int], list[float], list[int]]


class PendingSample(Protocol):
    """A step's sampled tokens on their way from the device to the host."""

    stream: Any  # the device stream the copy runs on (None on CPU): its event marks the step done

    def read_all(self) -> dict[str, list[tuple[int, TokenLogprobs | None]]]:
        """Request id -> its tokens in order (one, or a burst's), each with its logprobs (None when
        not asked); waits for the copy if it is not done."""
        ...


@dataclass
class ModelRunnerOutput:
    """The result of one step: the tokens sampled per request that sampled (one each, or up to
    `SchedulerOutput.num_steps` in a decode burst), in order."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (first prompt position covered, logprobs of the next prompt token per position)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # pooling requests whose prompt completed this step -> their pooled output (a CPU float32 tensor)
    pooled: dict[str, Any] = field(default_factory=dict)
    # requests the worker could not run (their own inputs failed it) -> why; the rest of the step ran
    failed: dict[str, str] = field(default_factory=dict)
    # with EPLB: tokens routed to each physical expert this step, [MoE layers][physical] (nested lists)
    expert_load: Any = None
    # a decode burst's steps that ran (a streamed burst may end early: `ModelRunner.execute`'s `on_step`)
    steps_run: int = 1
    # the step's sample while it is still being copied to the host (see `resolve`); never pickled
    pending: PendingSample | None = field(default=None, repr=False, compare=False)

    def resolve(self) -> None:
        """Fill `sampled_token_ids` and `logprobs` from the pending sample. Waits for its copy to
        the host: call it in a worker thread, or once the copy's `DeviceEvent` is done."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        for rid, sampled in pending.read_all().items():
            self.sampled_token_ids[rid] = [token for token, _ in sampled]
            if sampled[0][1] is not None:
                self.logprobs[rid] = [logprobs for _, logprobs in sampled if logprobs is not None]

    def __getstate__(self) -> dict[str, Any]:
        assert self.pending is None, "resolve() a step's output before sending it"
        return self.__dict__


# A streamed decode burst's consumer (`ModelRunner.execute`'s `on_step`): takes one step's tokens,
# returns whether the burst may go on.
StepSink = Callable[[ModelRunnerOutput], bool]
