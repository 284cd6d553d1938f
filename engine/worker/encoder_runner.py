"""One step of an encoder (BERT): every scheduled request whole, pooled, no sampling, no KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_info import PoolerConfig
from engine.models.bert import BertEncoder
from engine.models.pooler import finish, pool, pool_batch
from engine.pooling_params import PoolingParams
from engine.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, StepSink

MAX_ROWS_PER_FORWARD = 32


@dataclass
class EncoderRequest:
    token_type_ids: list[int] | None
    params: PoolingParams


class EncoderRunner:
    def __init__(self, model: BertEncoder, pooler: PoolerConfig, device: torch.device) -> None:
        self.model = model
        self.pooler = pooler
        self.device = device
        self.requests: dict[str, EncoderRequest] = {}

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, on_step: StepSink | None = None) -> ModelRunnerOutput:
        """The step's pooling requests (an encoder is never scheduled in bursts: `on_step` unused)."""
        for rid in sched_out.finished_request_ids:
            self.requests.pop(rid, None)
        for new in sched_out.new_requests:
            self.requests[new.request_id] = EncoderRequest(new.token_type_ids, new.pooling_params)
        out = ModelRunnerOutput()
        if sched_out.is_empty:
            return out
        # Length-sorted groups: padding every sequence to the step's longest one wastes compute.
        ordered = sorted(sched_out.scheduled, key=lambda item: item.num_tokens)
        for start in range(0, len(ordered), MAX_ROWS_PER_FORWARD):
            self._encode_group(ordered[start:start + MAX_ROWS_PER_FORWARD], out)
        return out

    def _encode_group(self, batch: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        hidden, lengths = self._encode(batch)
        pooled = pool_batch(hidden, lengths, self.pooler.pooling)  # every row at once: cheap per request
        for row, item in enumerate(batch):
            params = self.requests[item.request_id].params
            if params.task == "embed":
                out.pooled[item.request_id] = finish(pooled[row], params, self.pooler).cpu()
            else:
                out.pooled[item.request_id] = self._output(hidden[row, :item.num_tokens], params)

    def _encode(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(item.num_tokens for item in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        types = torch.zeros(len(batch), length, dtype=torch.long)
        for row, item in enumerate(batch):
            ids[row, :item.num_tokens] = torch.tensor(item.token_ids)
            token_types = self.requests[item.request_id].token_type_ids
            if token_types:
                types[row, :item.num_tokens] = torch.tensor(token_types)
        lengths = torch.tensor([item.num_tokens for item in batch], device=self.device)
        return self.model(ids.to(self.device), types.to(self.device), lengths), lengths

    def _output(self, hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.task == "classify":
            return self.model.classify(hidden[0:1])[0].cpu()
        if params.task == "token_embed":
            return finish(self.model.project_tokens(hidden), params, self.pooler).cpu()
        return finish(pool(hidden, self.pooler.pooling), params, self.pooler).cpu()
