"""Beam search over the engine, as vLLM v1 runs it: every step, each running beam is a request
of one token asking for the logprobs of its 2 x beam_width most likely next tokens; the
candidates of all beams are ranked by score and the best beam_width go on.

The beams of a prompt share its KV blocks through the prefix cache: a beam's request is the
prompt plus the beam's tokens, so its full blocks are hits and only the tail since the last
full block is computed again. Each step's requests run as one batch with everything else the
engine serves; cancelling the search aborts the step in flight.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any, Protocol

from engine.beam_search_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.errors import EngineDeadError
from engine.lora_request import LoRARequest
from engine.model_info import ModelInfo
from engine.outputs import RequestOutput
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import RequestOutputKind, SamplingParams


class BeamEngine(Protocol):
    """What beam search needs of the engine (`AsyncEngine` is one)."""

    info: ModelInfo
    tokenizer: Tokenizer

    def generate_batch(self, prompts: Sequence[Any], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """As `AsyncEngine.generate_batch`: closing the generator aborts its requests."""


def beam_score(tokens: list[int], cum_logprob: float, eos_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's score: the cumulative logprob over the sequence's length (prompt included, a final
    EOS not) to the power `length_penalty`."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / float(max(length, 1) ** length_penalty)


async def run_beam_search(engine: BeamEngine, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                          cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                          priority: int = 0) -> BeamSearchOutput:
    """The best `params.beam_width` beams continuing `prompt_ids`. Cancellation aborts the step in
    flight; nothing else is left running."""
    eos = frozenset() if params.ignore_eos else frozenset(engine.info.eos_token_ids)
    width = params.beam_width
    step = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=0.0, ignore_eos=True,
                          skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    running = [BeamSearchSequence(list(prompt_ids))]
    ended: list[BeamSearchSequence] = []
    for index in range(params.max_tokens):
        prompts = [_prompt(beam.tokens, cache_salt) for beam in running]
        outputs = await _one_token_each(engine, prompts, step, f"{request_id}-{index}", lora_request, priority)
        candidates = []
        for beam, output in zip(running, outputs, strict=True):
            logprobs = output.outputs[0].logprobs
            assert logprobs, "a beam step asks for logprobs"
            for token, entry in logprobs[0].items():
                extended = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + entry.logprob)
                if token in eos:
                    extended.finish_reason, extended.stop_reason = "stop", token
                    ended.append(extended)
                else:
                    candidates.append(extended)
        running = sorted(candidates, key=score, reverse=True)[:width]
        if _done(running, ended, params, score):
            break
    for beam in running:
        beam.finish_reason = "length"
    best = sorted(ended + running, key=score, reverse=True)[:width]
    for beam in best:
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            beam.tokens = beam.tokens[:-1]
        beam.text = engine.tokenizer.decode(beam.tokens[len(prompt_ids):])
    return BeamSearchOutput(best, list(prompt_ids))


def _done(running: list[BeamSearchSequence], ended: list[BeamSearchSequence], params: BeamSearchParams,
          score: Callable[[BeamSearchSequence], float]) -> bool:
    """Whether the search stops before max_tokens (see BeamSearchParams.early_stopping)."""
    if not running:
        return True
    if params.early_stopping == "never" or len(ended) < params.beam_width:
        return False
    if params.early_stopping is True:
        return True
    worst_kept = sorted((score(b) for b in ended), reverse=True)[params.beam_width - 1]
    return max(score(b) for b in running) <= worst_kept


def _prompt(tokens: list[int], cache_salt: str | None) -> dict[str, object]:
    prompt: dict[str, object] = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


async def _one_token_each(engine: BeamEngine, prompts: list[dict[str, object]], params: SamplingParams,
                          request_id: str, lora_request: LoRARequest | None, priority: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(prompts)
    async with aclosing(engine.generate_batch(prompts, params, request_id, priority=priority,
                                              lora_request=lora_request)) as outputs:
        async for index, output in outputs:
            finals[index] = output
    if any(f is None for f in finals):
        raise EngineDeadError("the engine stopped during a beam search")
    return finals  # type: ignore[return-value]
