"""Folding outputs that queued while a consumer was busy into one per request."""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from engine.core.engine_core import OutputItem
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.sampling_params import RequestOutputKind


def merge_pending(first: OutputItem, receive: MemoryObjectReceiveStream[OutputItem],
                   kind: RequestOutputKind) -> list[RequestOutput | PoolingRequestOutput]:
    """Fold outputs that queued while the consumer was busy into one per request, so a
    slow consumer handles one output per request per wake-up instead of one per step."""
    merged: dict[str, RequestOutput | PoolingRequestOutput] = {}
    item: OutputItem | None = first
    while item is not None:
        if isinstance(item, BaseException):
            raise item
        previous = merged.get(item.request_id)
        merged[item.request_id] = (merge_delta(previous, item) if kind is RequestOutputKind.DELTA
                                   and isinstance(previous, RequestOutput) and isinstance(item, RequestOutput)
                                   else item)
        try:
            item = receive.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            item = None
    return list(merged.values())


def merge_delta(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    for old, new in zip(a.outputs, b.outputs, strict=True):
        old.text += new.text
        old.token_ids = old.token_ids + new.token_ids
        if old.logprobs is not None and new.logprobs is not None:
            old.logprobs = old.logprobs + new.logprobs
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    a.finished = b.finished
    a.metrics = b.metrics
    a.prompt_logprobs = a.prompt_logprobs or b.prompt_logprobs
    return a
