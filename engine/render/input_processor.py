"""The input processor: a rendered prompt and its parameters, checked against the model and the
engine's limits, become the `EngineCoreRequest` the core runs (as vLLM's `InputProcessor`).

Every check that needs the model lives here, once, with one wording per error; `AsyncEngine` calls
it after rendering, and the HTTP layer reaches the same checks through the engine (`AsyncEngine.
processor`). Plain Python over the tokenizer: no event loop, so it is tested without one.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from engine.beam_search_params import BeamSearchParams
from engine.config import EngineConfig
from engine.core_request import POOLING_SAMPLING_PARAMS, EngineCoreRequest
from engine.errors import InvalidRequestError
from engine.lora_request import LoRARegistry, LoRARequest, configured_adapters
from engine.model_info import ModelInfo
from engine.pooling_params import PoolingParams
from engine.render.pooling_tasks import capable_pooling_tasks, served_pooling_tasks
from engine.render.renderer import EngineInput
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams


class InputProcessor:
    """Checks requests against one model and builds their `EngineCoreRequest`s."""

    def __init__(self, config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer,
                 loras: LoRARegistry | None = None) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.loras = loras if loras is not None else configured_adapters(config.lora_modules)

    def check_can_generate(self) -> None:
        """A pooling model (BERT and its kin, or any model under --runner pooling) serves
        embeddings, pooling, score and rerank only."""
        if self.info.kind == "encoder":
            raise InvalidRequestError(f"this model ({self.info.architecture}) is a pooling model and cannot "
                                      "generate; use embeddings, pooling, score or rerank", param="model")
        if self.config.runner == "pooling":
            raise InvalidRequestError("this server runs its model with --runner pooling: it serves embeddings, "
                                      "pooling, score and rerank, not generation", param="model")

    @functools.cached_property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks this engine serves (engine/render/pooling_tasks.py)."""
        return served_pooling_tasks(self.config, self.info)

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, with and without a leading space (as vLLM bans them)."""
        sequences = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, False)
                if ids:
                    sequences.add(tuple(ids))
        return tuple(sorted(sequences))

    def check_prompt_count(self, count: int) -> None:
        """At least one prompt, and at most `max_prompts_per_request` in one request."""
        if not count:
            raise InvalidRequestError("no prompt given", param="prompt")
        limit = self.config.max_prompts_per_request
        if count > limit:
            raise InvalidRequestError(f"{count} prompts in one request is more than the limit of {limit}",
                                      param="prompt")

    def check_beam_search(self, prompt: EngineInput, params: BeamSearchParams) -> None:
        """Beam search's bounds, known before its first step: a text or token-id prompt, the
        beams' logprobs within --max-logprobs, and the prompt with max_tokens within the context
        (vLLM's wording)."""
        if prompt.embeds is not None or prompt.mm_features:
            raise InvalidRequestError("beam search takes text or token-id prompts (not embeddings or images)",
                                      param="prompt")
        limit = self.config.max_logprobs
        if 2 * params.beam_width > limit:
            raise InvalidRequestError(f"beam search with n={params.beam_width} reads the {2 * params.beam_width} "
                                      f"most likely tokens of each beam; the server's --max-logprobs is {limit} "
                                      f"(n at most {limit // 2})", param="n")
        prompt_len, max_len = len(prompt.token_ids), self.info.max_model_len
        if prompt_len + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.", param="max_tokens")

    def check_priority(self, priority: int) -> None:
        """A priority only means something under the priority policy; elsewhere it is refused
        rather than ignored (vLLM's rule and wording)."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"Got priority {priority} but Priority scheduling is not enabled.",
                                      param="priority")

    def check_pooling(self, params: PoolingParams) -> None:
        """A task the engine serves (vLLM's wording for the others), and options the model supports."""
        info, served = self.info, self.pooling_tasks
        if params.task not in served:
            if served and params.task in capable_pooling_tasks(info):
                raise InvalidRequestError(f"Try switching the model's pooling_task via --pooler-config "
                                          f"'{{\"task\": \"{params.task}\"}}': this server serves "
                                          f"{list(served)}", param="task")
            hint = (" This model is a late-interaction model: it gives token embeddings (/pooling with task "
                    "token_embed) and scores by MaxSim (/score, /rerank)." if info.pooler.late_interaction else
                    " The server runs its model with --runner generate." if not served else "")
            raise InvalidRequestError(f"Unsupported task: {params.task!r} Supported tasks: {list(served)}.{hint}",
                                      param="task")
        if params.dimensions is not None and not info.pooler.supports_dimensions(params.dimensions):
            supported = info.pooler.matryoshka_dimensions
            raise InvalidRequestError(
                f"this model does not support dimensions={params.dimensions}" +
                (f" (Matryoshka dimensions up to {max(supported)})" if supported else
                 " (it does not declare Matryoshka support)"), param="dimensions")

    @property
    def pooling_input_limit(self) -> int:
        """The longest input one pooling request takes: the context, or one step if smaller (a
        pooling prompt is not chunked across steps)."""
        return min(self.info.max_model_len, self.config.token_budget)

    def pooling_request(self, request_id: str, engine_input: EngineInput, params: PoolingParams,
                        priority: int, arrival_time: float) -> EngineCoreRequest:
        """One prefill-only request; its prompt must fit the context and one step (it is not chunked)."""
        length = len(engine_input.token_ids)
        limit = self.pooling_input_limit
        if length > limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, your request "
                                      f"has {length} input tokens. Please reduce the length of the input prompt "
                                      "(or set truncate_prompt_tokens).", param="input")
        token_type_ids = engine_input.token_type_ids
        return EngineCoreRequest(request_id, engine_input.prompt, tuple(engine_input.token_ids),
                                 POOLING_SAMPLING_PARAMS, max_tokens=1, arrival_time=arrival_time,
                                 priority=priority, cache_key=engine_input.cache_key(request_id),
                                 prompt_embeds=engine_input.prompt_embeds(), pooling_params=params,
                                 token_type_ids=None if token_type_ids is None else tuple(token_type_ids))

    def _check_against_model(self, params: SamplingParams, engine_input: EngineInput) -> None:
        """The bounds that depend on the model and the engine's limits (SamplingParams checks the rest)."""
        prompt_len, max_len = len(engine_input.token_ids), self.info.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input prompt.", param="prompt")
        if params.max_tokens is not None and prompt_len + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.", param="max_tokens")
        if prompt_len + params.min_tokens > max_len:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) does not fit the context: {prompt_len} "
                                      f"prompt tokens of at most {max_len}", param="min_tokens")
        limits = {"n": self.config.max_num_seqs, "top_k": self.info.vocab_size,
                  "logprobs": self.config.max_logprobs, "prompt_logprobs": self.config.max_logprobs}
        for name, limit in limits.items():
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequestError(f"{name}={value} is more than the limit of {limit}", param=name)
        if engine_input.embeds is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported for prompt embeddings (the prompt has no "
                                      "tokens)", param="prompt_logprobs")
        vocab = self.info.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name} {bad[:8]} are out of vocabulary (size {vocab})", param=name)

    def prepared(self, engine_input: EngineInput, params: SamplingParams) -> EngineInput:
        """The prompt as it will run: truncated as asked, and checked against the model."""
        engine_input = _truncated(engine_input, params.truncate_prompt_tokens, params.truncation_side)
        self._check_against_model(params, engine_input)
        return engine_input

    def lora_name(self, lora_request: LoRARequest | None) -> str | None:
        """The adapter a request asks for, checked against those the engine serves."""
        if lora_request is None:
            return None
        served = self.loras.names()
        if lora_request.lora_name not in served:
            hint = f"; it serves {', '.join(served)}" if served else " (--enable-lora and --lora-modules)"
            raise InvalidRequestError(f"The model `{lora_request.lora_name}` does not exist: no LoRA adapter of "
                                      f"that name is served{hint}", param="model")
        return lora_request.lora_name

    def generation_request(self, request_id: str, engine_input: EngineInput, params: SamplingParams,
                           priority: int, arrival_time: float, lora_request: LoRARequest | None = None
                           ) -> EngineCoreRequest:
        """The request that runs `engine_input` (truncated and checked): EOS ids and bad words
        resolved, `max_tokens` what the context leaves when the caller set none. With an adapter,
        its blocks are its own in the prefix cache (the adapter changes every key and value)."""
        lora_name = self.lora_name(lora_request)
        engine_input = self.prepared(engine_input, params)
        token_ids = engine_input.token_ids
        if params.bad_words and not params.bad_words_token_ids:
            params = replace(params, bad_words_token_ids=self.bad_word_ids(params.bad_words))
        params = params.with_eos(self.info.eos_token_ids)
        max_tokens = self.info.max_model_len - len(token_ids) if params.max_tokens is None else params.max_tokens
        cache_key = engine_input.cache_key(request_id)
        if lora_name is not None:
            cache_key = (*(cache_key or ()), f"lora:{lora_name}")
        return EngineCoreRequest(request_id, engine_input.prompt, tuple(token_ids), params, max_tokens=max_tokens,
                                 arrival_time=arrival_time, priority=priority, cache_key=cache_key,
                                 prompt_embeds=engine_input.prompt_embeds(),
                                 mm_features=tuple(engine_input.mm_features), lora_name=lora_name)


def _truncated(engine_input: EngineInput, keep: int | None, side: str = "left") -> EngineInput:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens (vLLM's default, left truncation), or
    its first with `truncation_side="right"`."""
    if keep is None or len(engine_input.token_ids) <= keep:
        return engine_input
    if engine_input.embeds is not None or engine_input.mm_features:
        raise InvalidRequestError("truncate_prompt_tokens is not supported with prompt embeddings or images",
                                  param="truncate_prompt_tokens")
    kept = engine_input.token_ids[-keep:] if side == "left" else engine_input.token_ids[:keep]
    return replace(engine_input, token_ids=kept)
