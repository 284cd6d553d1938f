"""The trio-native engine API: `open_engine` and `AsyncEngine.generate`.

    async with open_engine(EngineConfig(model=path)) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            ...

The engine's step loop runs as a task in the task group `open_engine` opens;
leaving the `async with` block stops it and fails any request still open with
`EngineDeadError`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

import anyio
import torch

from engine.api.beam_search import run_beam_search
from engine.api.chunked_pooling import ChunkPlan
from engine.api.pending_outputs import merge_pending
from engine.beam_search_params import BeamSearchOutput, BeamSearchParams
from engine.concurrency.use_counts import UseCounts
from engine.config import EngineConfig
from engine.core.engine_core import AddRequest, CoreHandle, OutputItem
from engine.core.stats import EngineStats, LoopLagReadings
from engine.core_request import EngineCoreRequest
from engine.errors import EngineDeadError, InvalidRequestError
from engine.ids import random_id
from engine.lora_request import LoRARequest, check_names_given, configured_adapters
from engine.model_info import ModelInfo
from engine.models.pooler import finish
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.render.chat import EMBEDS_SENTINEL, ChatMedia, extract_media, render_chat
from engine.render.grammar import GrammarCompiler
from engine.render.input_processor import InputProcessor
from engine.render.prompt_embeds import EmbedsLimits
from engine.render.prompt_images import ImageLimits, ImageSpec
from engine.render.renderer import EngineInput, Prompt, Renderer
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import RequestOutputKind, SamplingParams


class AsyncEngine:
    """The trio-native engine surface; get one from `open_engine`.

    Public: `generate`, `generate_batch`, `chat`, `encode`, `apply_chat_template`,
    `add_lora`, `remove_lora`, `stats()`, `is_running`, and the read-only facts `config`,
    `info` (the model, sized), `tokenizer` and `loras` (the LoRA adapters served). `core` is
    the engine-core task's object (an `EngineCore`; behind `open_engine_process`, the
    `CoreClient` of the engine process), for white-box tests only: its state belongs to that task.
    """

    def __init__(self, config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer, core: CoreHandle,
                 loop_lag: LoopLagReadings | None = None, *, sampling_defaults: dict[str, Any] | None = None,
                 image_spec: ImageSpec | None = None) -> None:
        self.config = config
        # Defaults for sampling fields a request leaves unset (`EngineConfig.generation_config`); the
        # HTTP server applies them, as vLLM does; library callers pass whole SamplingParams.
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})
        self.info = info
        self.tokenizer = tokenizer
        self.core = core
        self.loras = configured_adapters(config.lora_modules)
        self._lora_lock = anyio.Lock()  # one adapter load or unload at a time
        self._adapter_streams = UseCounts()  # open generate calls per adapter
        self.processor = InputProcessor(config, info, tokenizer, self.loras)
        self.pooling_tasks = self.processor.pooling_tasks  # what /pooling, /classify and /score may ask
        self._loop_lag = loop_lag or LoopLagReadings()
        self.render_limiter = anyio.CapacityLimiter(config.renderer_threads)
        embeds_limits = None
        if config.enable_prompt_embeds:
            embeds_limits = EmbedsLimits.for_model(info.hidden_size, info.max_model_len, getattr(torch, info.dtype),
                                                   config.max_prompt_embeds_bytes)
        image_limits = ImageLimits(config.limit_images_per_prompt, config.max_image_bytes, config.max_image_pixels,
                                   config.allowed_media_domains)
        self.renderer = Renderer(tokenizer, info.vocab_size, self.render_limiter, embeds_limits,
                                 image_spec=image_spec, image_limits=image_limits)
        eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self.grammars = GrammarCompiler(tokenizer.backend, info.vocab_size, eos, self.render_limiter,
                                        config.structured_outputs_config.max_integer_digits)

    # ---- the main entry points -------------------------------------------------------------
    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput]:
        """Generate for one prompt, yielding `RequestOutput`s as tokens arrive.

        `prompt` is text, a list of token ids, a tensor of prompt embeddings
        (rows x hidden size, when the engine was opened with
        `enable_prompt_embeds`), or a mapping with `prompt`, `prompt_token_ids`
        or `prompt_embeds` (a tensor, or base64 of a `torch.save` file).
        Invalid input raises `InvalidRequestError` before anything runs.
        `lora_request` names one of the engine's LoRA adapters; one it does not
        serve yet is loaded first from its `lora_path` (`add_lora`), as vLLM does.
        Cancelling the consuming task, or closing the generator
        (`aclose()`, or leaving an `aclosing()` block early), aborts the
        request: it is dropped between two steps and its KV blocks are freed.
        If the engine stops first, `EngineDeadError` is raised.
        """
        request_id = request_id or random_id()
        # aclosing: closing this generator closes the inner one at once, so its abort is sent now
        # rather than whenever the garbage collector finalizes it.
        async with aclosing(self._generate([prompt], sampling_params, [request_id], priority,
                                           lora_request)) as outputs:
            async for _, output in outputs:
                yield output

    async def generate_batch(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | None = None,
                             request_id: str | None = None, *, priority: int = 0,
                             lora_request: LoRARequest | None = None) -> AsyncGenerator[tuple[int, RequestOutput]]:
        """Generate for several prompts at once, yielding `(prompt index, output)` as outputs arrive.

        All prompts are validated before any is queued; one bad prompt fails
        the whole batch with nothing run. Request ids are `{request_id}-{i}`.
        Cancellation or closing the generator aborts every unfinished one.
        """
        request_id = request_id or random_id()
        request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        async with aclosing(self._generate(prompts, sampling_params, request_ids, priority,
                                           lora_request)) as outputs:
            async for item in outputs:
                yield item

    async def beam_search(self, prompt: Prompt, params: BeamSearchParams, request_id: str | None = None, *,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """The best `params.beam_width` continuations of a text or token-id prompt by beam search
        (engine/api/beam_search.py): each step runs every beam as a one-token request, and the
        beams share the prompt's KV blocks through the prefix cache. Invalid input raises
        `InvalidRequestError` before anything runs. Cancellation aborts the step in flight."""
        self.processor.check_can_generate()
        (rendered,) = await self._render_all([prompt])
        self.processor.check_beam_search(rendered, params)
        return await run_beam_search(self, rendered.token_ids, params, request_id or random_id(),
                                     rendered.cache_salt, lora_request, priority)

    async def encode(self, prompts: Sequence[Prompt], pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, priority: int = 0) -> list[PoolingRequestOutput]:
        """Pool every prompt (embed, token_embed or classify); one output per prompt, in input order.

        Pooling requests are prefill-only requests in the same batches as
        generation; their KV blocks are freed after their step. All prompts
        are validated first. Cancellation aborts every unfinished one.
        """
        params = pooling_params or PoolingParams()
        self.processor.check_pooling(params)
        self.processor.check_priority(priority)
        request_id = request_id or random_id()
        rendered = await self._render_all(prompts)
        if params.task == "embed" and self.config.pooler_config.enable_chunked_processing:
            return await self._encode_in_chunks(rendered, params, request_id, priority)
        return await self._encode_rendered(rendered, params, request_id, priority)

    async def _encode_rendered(self, rendered: list[EngineInput], params: PoolingParams, request_id: str,
                               priority: int) -> list[PoolingRequestOutput]:
        request_ids = [f"{request_id}-{i}" for i in range(len(rendered))]
        results: list[PoolingRequestOutput | None] = [None] * len(rendered)
        build = partial(self._pooling_request, params=params, priority=priority)
        async with aclosing(self._run_rendered(rendered, request_ids, build, RequestOutputKind.FINAL_ONLY)) \
                as outputs:
            async for index, output in outputs:
                results[index] = output
        if any(r is None for r in results):
            raise EngineDeadError("the engine stopped before every prompt was pooled")
        return results  # type: ignore[return-value]

    async def _encode_in_chunks(self, rendered: list[EngineInput], params: PoolingParams, request_id: str,
                                priority: int) -> list[PoolingRequestOutput]:
        """--pooler-config enable_chunked_processing: inputs longer than one step are embedded in
        chunks, pooled raw, and combined as their token-weighted mean, then cut to `dimensions` and
        normalized (exact for MEAN pooling; for CLS and LAST the mean of the chunks' vectors)."""
        plan = ChunkPlan.of(rendered, self.processor.pooling_input_limit, self.config.pooler_config.max_embed_len)
        raw = replace(params, normalize=False, dimensions=None, use_activation=None)
        outputs = await self._encode_rendered(plan.chunks, raw, request_id, priority)
        return plan.combine(outputs, rendered, lambda vector: finish(vector, params, self.info.pooler))

    async def _generate(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | None,
                        request_ids: list[str], priority: int, lora_request: LoRARequest | None = None
                        ) -> AsyncGenerator[tuple[int, RequestOutput]]:
        self.processor.check_can_generate()
        self.processor.check_priority(priority)
        with self._adapter_streams.using(lora_request.lora_name) if lora_request else contextlib.nullcontext():
            await self._load_new_adapter(lora_request)
            self.processor.lora_name(lora_request)  # an unknown adapter fails before rendering
            params = await self._with_grammar(sampling_params or SamplingParams())
            if params.truncate_prompt_tokens is None:  # else the text is cut to fit: all of it is needed
                await self.refuse_texts_too_long([_text_of(p) for p in prompts])
            build = partial(self._generation_request, params=params, priority=priority, lora_request=lora_request)
            async with aclosing(self._run(prompts, request_ids, build, params.output_kind)) as outputs:
                async for item in outputs:
                    yield item

    async def refuse_texts_too_long(self, texts: Sequence[str | None]) -> None:
        """Raise the context-length error (`InvalidRequestError`) for the first text that surely
        cannot fit the context, tokenizing a bounded prefix of each long one only (not the whole: a
        15 MiB prompt took 15 s to refuse). Cancellation drops a worker thread's result once the
        thread returns."""
        for text in texts:
            if text:
                await self.renderer.refuse_if_too_long(text, self.info.max_model_len)

    # ---- LoRA adapters -----------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, *, replace: bool = False) -> LoRARequest:
        """Serve the PEFT adapter in `lora_request.lora_path` as `lora_request.lora_name` from
        now on; returns it with its id. With `replace`, one of that name is replaced in place: its
        running requests read the new weights from their next step. The workers read and check it
        between steps (never on the event loop). An adapter that cannot be served raises `LoRAError`
        (a wrong name or state `InvalidRequestError`) and nothing changes.

        Cancellation stops the wait: the adapter is then not served (the workers may hold it; a
        later add of that name replaces it)."""
        name, path = lora_request.lora_name, lora_request.lora_path
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        check_names_given(lora_request)
        async with self._lora_lock:
            if name in self.loras.unloading:
                raise InvalidRequestError(f"The lora adapter '{name}' is being unloaded; load it again once that "
                                          "has finished.", param="lora_name")
            if name in self.loras and not replace:
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded. If you want to load "
                                          "the adapter in place, set 'load_inplace' to True.", param="lora_name")
            await self.core.add_lora(name, path)
            return self.loras.add(lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """Stop serving adapter `lora_name`: requests for it are refused from now on, those already
        made finish with its weights, then the workers drop it. `InvalidRequestError` if it is not
        served.

        Cancellation stops the wait and leaves the adapter unserved (its weights stay on the workers
        until a later add of that name replaces them)."""
        if lora_name not in self.loras:
            raise InvalidRequestError(f"The lora adapter '{lora_name}' cannot be found.", param="lora_name")
        self.loras.start_unloading(lora_name)
        try:
            await self._adapter_streams.wait_unused(lora_name)
            await self.core.remove_lora(lora_name)
        finally:
            self.loras.unloaded(lora_name)

    async def _load_new_adapter(self, lora_request: LoRARequest | None) -> None:
        """vLLM's library behaviour: a request may bring an adapter by path that the engine has not
        served yet; it is loaded first (once, however many requests bring it at once)."""
        if lora_request is None or not lora_request.lora_path or lora_request.lora_name in self.loras:
            return
        with contextlib.suppress(InvalidRequestError):  # already loaded meanwhile; unloading: refused below
            await self.add_lora(lora_request)

    async def _with_grammar(self, params: SamplingParams) -> SamplingParams:
        """`params` with its structured outputs compiled (in a worker thread, cached by grammar);
        the request enters the scheduler only with a grammar that compiled."""
        spec = params.structured_outputs
        if spec is None or spec.compiled is not None:
            return params
        return replace(params, structured_outputs=await self.grammars.compile(spec))

    async def render(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | None = None
                     ) -> list[EngineInput]:
        """What `generate_batch` would run for `prompts`, without running anything: each prompt
        rendered (tokenized, images decoded and hashed), truncated and checked against the model,
        with the same errors. Rendering runs in worker threads; cancellation drops their results
        once the threads return."""
        params = sampling_params or SamplingParams()
        self.processor.check_can_generate()
        return [self.processor.prepared(engine_input, params) for engine_input in await self._render_all(prompts)]

    def _generation_request(self, request_id: str, engine_input: EngineInput, params: SamplingParams,
                            priority: int, lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        return self.processor.generation_request(request_id, engine_input, params, priority, anyio.current_time(),
                                                 lora_request)

    def _pooling_request(self, request_id: str, engine_input: EngineInput, params: PoolingParams,
                         priority: int) -> EngineCoreRequest:
        return self.processor.pooling_request(request_id, engine_input, params, priority, anyio.current_time())

    async def _render_all(self, prompts: Sequence[Prompt]) -> list[EngineInput]:
        self.processor.check_prompt_count(len(prompts))
        return await self.renderer.render(prompts)

    async def _run(self, prompts: Sequence[Prompt], request_ids: list[str],
                   make_request: Callable[[str, EngineInput], EngineCoreRequest],
                   output_kind: RequestOutputKind) -> AsyncGenerator[tuple[int, Any]]:
        rendered = await self._render_all(prompts)
        async with aclosing(self._run_rendered(rendered, request_ids, make_request, output_kind)) as outputs:
            async for item in outputs:
                yield item

    async def _run_rendered(self, rendered: list[EngineInput], request_ids: list[str],
                            make_request: Callable[[str, EngineInput], EngineCoreRequest],
                            output_kind: RequestOutputKind) -> AsyncGenerator[tuple[int, Any]]:
        requests = [make_request(rid, engine_input) for rid, engine_input in zip(request_ids, rendered, strict=True)]
        # One output stream for the whole batch: each request gets a clone of the send side,
        # so the outputs of every prompt arrive on one receive side without extra tasks.
        send, receive = anyio.create_memory_object_stream[OutputItem](math.inf)
        index_of = {rid: i for i, rid in enumerate(request_ids)}
        open_ids: set[str] = set()  # submitted and not finished: aborted if we leave early
        try:
            with receive:
                with send:
                    for request in requests:
                        self.core.submit(AddRequest(request, send.clone()))
                        open_ids.add(request.request_id)
                async for item in receive:
                    for output in merge_pending(item, receive, output_kind):
                        if output.finished:
                            open_ids.discard(output.request_id)
                        yield index_of[output.request_id], output
                    if not open_ids:
                        return
            raise EngineDeadError("the engine stopped before the request finished")
        except BaseException as exc:
            if isinstance(exc, EngineDeadError):
                open_ids.clear()  # the core holds nothing any more
            elif isinstance(exc, InvalidRequestError):
                open_ids.discard(exc.request_id)  # the one the core refused
            raise
        finally:
            for rid in open_ids:
                self.core.abort(rid)

    async def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, **template_kwargs: Any) -> AsyncGenerator[RequestOutput]:
        """Render `messages` with the model's chat template, then generate as `generate` does.

        Cancellation aborts the request, as with `generate`.
        """
        prompt_input = await self.chat_prompt(messages, **template_kwargs)
        async with aclosing(self.generate(prompt_input, sampling_params, request_id)) as outputs:
            async for output in outputs:
                yield output

    async def chat_prompt(self, messages: list[dict[str, Any]], *, continue_final_message: bool = False,
                          **template_kwargs: Any) -> dict[str, Any]:
        """The prompt `chat` runs for `messages`: the template's text, its token ids and the images
        of the messages' `image_url` / `image` parts (`multi_modal_data`), ready for `generate`.
        With `continue_final_message` the prompt ends right after the final message's text (an
        assistant turn to continue), as vLLM renders it.

        Template rendering and tokenization of long prompts run in worker threads; cancellation
        drops their results once the threads return."""
        spec = self.renderer.image_spec
        messages, media = extract_media(messages, self.tokenizer.chat_template,
                                        spec.image_token if spec else "<image>")
        if media.images and spec is None:
            raise InvalidRequestError("this model does not take images", param="messages")
        if continue_final_message:
            if template_kwargs.get("add_generation_prompt"):
                raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                          param="continue_final_message")
            template_kwargs["add_generation_prompt"] = False
        prompt = await self.apply_chat_template(messages, **template_kwargs)
        if continue_final_message:
            prompt = _cut_after_final_message(prompt, messages)
        if media.embeds:
            return await self._with_embeds_parts(prompt, media)
        token_ids = await self._tokenize(prompt, add_special_tokens=False)
        prompt_input: dict[str, Any] = {"prompt": prompt, "prompt_token_ids": token_ids}
        if media.images:
            prompt_input["multi_modal_data"] = {"image": media.images}
        return prompt_input

    async def _with_embeds_parts(self, prompt: str, media: ChatMedia) -> dict[str, Any]:
        """The rendered template's text tokenized around its prompt_embeds parts: token ids, and
        where in them each part's rows go (`prompt_embeds_parts`, decoded by the renderer)."""
        if media.images:
            raise InvalidRequestError("prompt_embeds parts cannot be combined with images in one request",
                                      param="messages")
        pieces = prompt.split(EMBEDS_SENTINEL)
        if len(pieces) != len(media.embeds) + 1:
            raise InvalidRequestError(f"the chat template rendered {len(pieces) - 1} of the {len(media.embeds)} "
                                      "prompt_embeds parts; each must appear once", param="messages")
        token_ids: list[int] = []
        positions = []
        for index, piece in enumerate(pieces):
            if index:
                positions.append(len(token_ids))
            if piece:
                token_ids += await self._tokenize(piece, add_special_tokens=False)
        return {"prompt_token_ids": token_ids, "prompt_embeds_parts": list(zip(positions, media.embeds, strict=True))}

    async def apply_chat_template(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                                  **kwargs: Any) -> str:
        """Render with the model's chat template (or `chat_template`, given). Rendering runs in a
        worker thread under the renderer's limiter; cancellation drops its result once the thread
        returns.
        """
        tok = self.tokenizer
        template = chat_template or tok.chat_template
        return await anyio.to_thread.run_sync(
            lambda: render_chat(template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token, **kwargs),
            limiter=self.render_limiter)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (long texts are tokenized in a worker thread). Empty text is an error.

        Long texts are tokenized in a worker thread; cancellation drops the result once the thread
        returns.
        """
        return await self._tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; ids outside the vocabulary raise `InvalidRequestError`."""
        return self.tokenizer.decode(self._check_token_ids(token_ids, allow_empty=True))

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if it already finished)."""
        self.core.abort(request_id)

    @property
    def prompt_embeds_limits(self) -> EmbedsLimits | None:
        """The limits prompt embeddings are checked against; None when they are refused."""
        return self.renderer.embeds_limits

    def stats(self) -> EngineStats:
        """A snapshot of the engine now (synchronous: it reads plain counters between steps)."""
        return replace(self.core.stats(), loop_lag=self._loop_lag.last, loop_lag_max=self._loop_lag.max)

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's snapshot, in data-parallel rank order (one engine: `[stats()]`, without
        the loop lag). `stats()` sums them."""
        return self.core.engine_stats()

    @property
    def engine_pids(self) -> tuple[int, ...]:
        """The engine processes' pids, in data-parallel rank order; none when the engine core runs
        in this process (`open_engine`)."""
        return self.core.pids

    def check_can_generate(self) -> None:
        """`InvalidRequestError` (naming `model`) if the model only pools (an embedding model)."""
        self.processor.check_can_generate()

    @property
    def pooling_input_limit(self) -> int:
        """The most tokens one pooling input may have (the context, or `max_embed_len` with chunked
        processing)."""
        return self.processor.pooling_input_limit

    @property
    def is_running(self) -> bool:
        return not self.core.dead

    # ---- input handling -----------------------------------------------------------------------
    async def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.renderer.tokenize(text, add_special_tokens)

    def _check_token_ids(self, token_ids: Sequence[int], allow_empty: bool = False) -> list[int]:
        return self.renderer.check_token_ids(token_ids, allow_empty)


def _cut_after_final_message(prompt: str, messages: list[dict[str, Any]]) -> str:
    """The rendered prompt up to the end of the final message's text (what follows closes the turn)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final or final not in prompt:
        raise InvalidRequestError("continue_final_message needs a final message with text content",
                                  param="continue_final_message")
    return prompt[:prompt.rfind(final) + len(final)]


def _text_of(prompt: Prompt) -> str | None:
    """A prompt's text, when it is text to tokenize (not token ids, embeddings or a rendered chat)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and prompt.get("prompt_token_ids") is None and isinstance(prompt.get("prompt"), str):
        return str(prompt["prompt"])
    return None
