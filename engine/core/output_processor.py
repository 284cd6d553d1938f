"""Turning scheduler updates into `RequestOutput`s for one user request.

A user request with `n` samples is one `RequestTracker` with `n` child
sequences in the scheduler. The tracker detokenizes each child's new tokens,
applies stop strings, collects logprobs, and builds the output its consumer
receives: cumulative, delta or final-only, as the request asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core_request import EngineCoreRequest
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from engine.render.detokenizer import IncrementalDetokenizer
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import RequestOutputKind
from engine.sched.output import TokenLogprobs
from engine.sched.request import Request


def to_position_logprobs(entry: TokenLogprobs, tokenizer: Tokenizer) -> PositionLogprobs:
    ids, lps, ranks = entry
    return {tid: Logprob(lp, rank, tokenizer.decode([tid], skip_special_tokens=False))
            for tid, lp, rank in zip(ids, lps, ranks, strict=True)}


@dataclass(frozen=True)
class RequestPrompt:
    """What every output of a request repeats about its prompt."""

    prompt: str | None
    visible_token_ids: list[int]  # none for a prompt of embeddings: its ids are placeholders
    num_prompt_tokens: int

    @classmethod
    def of(cls, request: EngineCoreRequest) -> RequestPrompt:
        ids = list(request.prompt_token_ids)
        return cls(request.prompt, [] if request.prompt_embeds is not None else ids, len(ids))


@dataclass
class ChildSequence:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestTracker:
    def __init__(self, request: EngineCoreRequest, children: list[Request], tokenizer: Tokenizer) -> None:
        """`children`: the scheduler's requests built from `request`, one per sample."""
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = prompt_token_ids = children[0].prompt_token_ids
        self.params = params = children[0].sampling_params
        self.tokenizer = tokenizer
        self.children = [ChildSequence(i, r, IncrementalDetokenizer(tokenizer, r.sampling_params),
                                       logprobs=[] if params.wants_logprobs else None,
                                       cumulative_logprob=0.0 if params.wants_logprobs else None)
                         for i, r in enumerate(children)]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self._prompt_logprobs_sent = False
        self.prompt_facts = RequestPrompt.of(request)
        self.metrics = {"arrival_time": request.arrival_time}

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def child(self, request_id: str) -> ChildSequence:
        return next(c for c in self.children if c.request.request_id == request_id)

    def add_tokens(self, child: ChildSequence, token_ids: list[int], logprobs: list[TokenLogprobs],
                   stop_terminated: bool = False) -> str | None:
        """Record new tokens; returns the stop string that matched, if any. `stop_terminated`: the
        last one is the EOS or stop token that finished the sequence (kept in the ids, not the text).
        Tokens after the one that completed a stop string (a decode burst's) are dropped."""
        rendered = child.detokenizer.num_tokens
        stop = child.detokenizer.add_tokens(token_ids, stop_terminated)
        if stop is not None:
            kept = child.detokenizer.num_tokens - rendered
            token_ids, logprobs = token_ids[:kept], logprobs[:kept]
        child.token_ids.extend(token_ids)
        for entry in logprobs:
            assert child.logprobs is not None and child.cumulative_logprob is not None
            child.logprobs.append(to_position_logprobs(entry, self.tokenizer))
            child.cumulative_logprob += entry[1][0]
        return stop

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        if self.prompt_logprobs is None:
            return
        for j, entry in enumerate(entries):
            self.prompt_logprobs[start + j + 1] = to_position_logprobs(entry, self.tokenizer)

    def finish_child(self, child: ChildSequence, reason: str, stop_reason: int | str | None) -> None:
        child.finish_reason = reason
        child.stop_reason = stop_reason

    def build_output(self) -> RequestOutput | None:
        """The output to send now, or None when there is nothing to say yet."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outputs = [self._completion(c, delta=kind is RequestOutputKind.DELTA) for c in self.children]
        prompt_logprobs = None
        if self.prompt_logprobs is not None and (kind is not RequestOutputKind.DELTA or not self._prompt_logprobs_sent):
            prompt_logprobs = self.prompt_logprobs
            self._prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_facts.visible_token_ids,
            num_prompt_tokens=self.prompt_facts.num_prompt_tokens,
            outputs=outputs, finished=finished, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(0, self.children[0].request.num_cached_tokens), metrics=dict(self.metrics))

    def _completion(self, child: ChildSequence, delta: bool) -> CompletionOutput:
        new_text = child.detokenizer.take_new_text(child.finished)
        if delta:
            start = child.sent_tokens
            text, token_ids = new_text, child.token_ids[start:]
            logprobs = child.logprobs[start:] if child.logprobs is not None else None
        else:
            text, token_ids = child.detokenizer.released_text, list(child.token_ids)
            logprobs = list(child.logprobs) if child.logprobs is not None else None
        child.sent_tokens = len(child.token_ids)
        return CompletionOutput(index=child.index, text=text, token_ids=token_ids,
                                cumulative_logprob=child.cumulative_logprob, logprobs=logprobs,
                                finish_reason=child.finish_reason, stop_reason=child.stop_reason)
