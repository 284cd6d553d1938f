"""`LLM`: a blocking facade for scripts, with vLLM's `LLM` names.

    llm = LLM(model="path/to/model", dtype="float32")
    outputs = llm.generate(["Hello", "The capital of"], SamplingParams(max_tokens=16))

Each call runs its own `trio.run` around an engine opened on the same loaded
worker, so no event loop or thread outlives a call and the model loads once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import anyio
from tqdm import tqdm

from engine.api.async_engine import AsyncEngine
from engine.api.open import open_engine
from engine.beam_search_params import BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.executor.inproc import InProcExecutor
from engine.hub import resolve_model_files
from engine.lora_request import LoRARequest
from engine.models.tiny import ensure_default_model
from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.render.renderer import Prompt
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`model`: an HF-format directory or a Hugging Face hub id, downloaded here if the hub cache
        lacks it (default: the embedded tiny model). `engine_options`: any `EngineConfig` field,
        e.g. `dtype`, `max_model_len`, `revision`."""
        unknown = set(engine_options) - EngineConfig.option_names()
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.config = resolve_model_files(EngineConfig(model=model or str(ensure_default_model()), **engine_options))
        # An in-process worker keeps its loaded model across calls; worker processes belong to
        # one `trio.run`, so with them (tensor_parallel_size > 1) each call starts them anew.
        self._executor = InProcExecutor(self.config) if self.config.executor_kind == "inproc" else None
        self._tokenizer = Tokenizer(self.config.tokenizer_path)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in prompt order. `lora_request`: one of the
        engine's adapters (`lora_modules`) for every prompt, or one (or None) per prompt."""
        batch = _as_batch(prompts)
        params = sampling_params or SamplingParams()
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(batch)
        else:
            loras = list(lora_request)
            if len(loras) != len(batch):
                raise ValueError(f"{len(loras)} lora_requests for {len(batch)} prompts")
        items = [("generate", p, lora) for p, lora in zip(batch, loras, strict=True)]
        return anyio.run(self._run_batch, items, params, use_tqdm, backend="trio")

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: SamplingParams | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Render each conversation with the chat template and generate a reply for it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = sampling_params or SamplingParams()
        items: list[tuple[str, Any, LoRARequest | None]] = [("chat", c, None) for c in conversations]
        return anyio.run(self._run_batch, items, params, use_tqdm, backend="trio")

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """One `BeamSearchOutput` per prompt (text or token ids), in prompt order: its best
        `params.beam_width` beams, best first (vLLM's `LLM.beam_search`). The prompts' searches run
        concurrently, their steps batched together."""
        return anyio.run(self._beam_search, _as_batch(prompts), params, lora_request, backend="trio")

    async def _beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams,
                           lora_request: LoRARequest | None) -> list[BeamSearchOutput]:
        results: list[BeamSearchOutput | None] = [None] * len(prompts)

        async def search(engine: AsyncEngine, index: int) -> None:
            results[index] = await engine.beam_search(prompts[index], params, lora_request=lora_request)

        async with (open_engine(self.config, executor=self._executor, tokenizer=self._tokenizer) as engine,
                    anyio.create_task_group() as tg):
            for index in range(len(prompts)):
                tg.start_soon(search, engine, index)
        return [r for r in results if r is not None]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """One pooled output per prompt, in prompt order (`PoolingParams(task=...)` for token
        embeddings or classification)."""
        return anyio.run(self._encode, _as_batch(prompts), pooling_params, backend="trio")

    async def _encode(self, prompts: Sequence[Prompt], params: PoolingParams | None) -> list[PoolingRequestOutput]:
        async with open_engine(self.config, executor=self._executor, tokenizer=self._tokenizer) as engine:
            return await engine.encode(prompts, params)

    def get_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    async def _run_batch(self, items: list[tuple[str, Any, LoRARequest | None]], params: SamplingParams,
                         use_tqdm: bool) -> list[RequestOutput]:
        params = _final_only(params)
        results: list[RequestOutput | None] = [None] * len(items)
        with tqdm(total=len(items), disable=not use_tqdm or len(items) < 2, desc="Processed prompts") as bar:
            async with (open_engine(self.config, executor=self._executor, tokenizer=self._tokenizer) as engine,
                        anyio.create_task_group() as tg):
                for index, item in enumerate(items):
                    tg.start_soon(_collect, engine, index, item, params, results, bar)
        return [r for r in results if r is not None]


def _final_only(params: SamplingParams) -> SamplingParams:
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, a mapping) as a batch of one; a sequence of prompts as it is."""
    single = isinstance(prompts, (str, dict)) or _is_token_list(prompts)
    return [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))


def _is_token_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], int)


async def _collect(engine: AsyncEngine, index: int, item: tuple[str, Any, LoRARequest | None], params: SamplingParams,
                   results: list[RequestOutput | None], bar: tqdm[Any]) -> None:
    kind, payload, lora = item
    stream = engine.generate(payload, params, lora_request=lora) if kind == "generate" else engine.chat(payload, params)
    async for output in stream:
        results[index] = output
    bar.update(1)
