"""The renderer: every prompt form in, engine input out, with costly work kept off the event loop.

Prompt forms: text (tokenized), token ids (checked against the vocabulary),
and prompt embeddings (a tensor, or base64 of a `torch.save` file). All the
prompts of one request render concurrently, one task each; the costly ones
(long texts, embeddings payloads) run in worker threads under one shared
`CapacityLimiter`, so a burst of large requests queues there instead of
starving the loop. Results come back in input order; if one prompt fails
the others are cancelled and the caller gets the failure of the first bad
prompt (by input position).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import anyio
import torch

from engine.concurrency.gather import gather_first_failure
from engine.concurrency.offload import run_sized
from engine.core_request import PromptEmbeds
from engine.errors import InvalidRequestError
from engine.mm_features import ImageFeature
from engine.render.prompt_embeds import EmbedsLimits, check_prompt_embeds, decode_prompt_embeds
from engine.render.prompt_images import ImageLimits, ImageSpec, expand_placeholders, process_images
from engine.render.tokenizer import Tokenizer

# Tokenizing text shorter than this on the loop costs less than the ~100-200 us thread hop.
INLINE_TOKENIZE_CHARS = 4096
# A text longer than this many characters per token of context has its prefix of that length
# tokenized first: if the prefix alone fills the context, the whole cannot fit, and the request is
# refused without tokenizing the rest (15 s for a 15 MiB prompt). English runs about 4 characters a
# token; a text with more per token than this is tokenized whole.
PROBE_CHARS_PER_TOKEN = 16
# Checking a library-given tensor may densify or cast it: worth a thread only from this size on.
INLINE_TENSOR_BYTES = 1 << 20

# (base64 payload, limits) -> a checked (rows, hidden) tensor.
PayloadDecoder = Callable[[str | bytes | bytearray | memoryview, EmbedsLimits], torch.Tensor]

Prompt = str | Sequence[int] | torch.Tensor | Mapping[str, Any]

DEFAULT_IMAGE_LIMITS = ImageLimits()

EMBEDS_DISABLED = ("prompt embeddings are not enabled; start the server with --enable-prompt-embeds "
                   "(EngineConfig(enable_prompt_embeds=True) for the library)")


@dataclass
class EngineInput:
    """One rendered prompt. For an embeddings prompt `token_ids` are placeholders giving its length."""

    prompt: str | None
    token_ids: list[int]
    embeds: torch.Tensor | None = None
    # Where `embeds`' rows go: (first position, rows) per span; None: over the whole prompt.
    embeds_spans: tuple[tuple[int, int], ...] | None = None
    token_type_ids: list[int] | None = None  # segment ids of a sentence pair (cross-encoders)
    # Requests with different salts never share prefix-cache blocks (vLLM's `cache_salt`).
    cache_salt: str | None = None
    mm_features: list[ImageFeature] = field(default_factory=list)  # images, in prompt order

    def prompt_embeds(self) -> PromptEmbeds | None:
        """The given embedding rows with the positions they take, as the engine core runs them."""
        if self.embeds is None:
            return None
        return PromptEmbeds(self.embeds, self.embeds_spans) if self.embeds_spans else PromptEmbeds.whole(self.embeds)

    def cache_key(self, request_id: str) -> tuple[str, ...] | None:
        """The prefix-cache namespace of this prompt. Embeddings prompts get their own per request:
        their placeholder ids must never match a token prompt (the samples of one request may
        share it: same embeddings). Prompts with images are keyed by the images' hashes: the
        same placeholders with other pictures must not share KV."""
        key: tuple[str, ...] = ("prompt_embeds", request_id) if self.embeds is not None else ()
        key += ("cache_salt", self.cache_salt) if self.cache_salt is not None else ()
        key += tuple(f"image:{f.mm_hash}" for f in self.mm_features)
        return key or None


class Renderer:
    """Renders prompts into `EngineInput`s.

    `decode_payload` turns a base64 prompt-embeddings payload into a checked
    tensor; it always runs in a worker thread (the default is the engine's
    pickle-free decoder; the loop-lag benchmark passes `torch.load` to compare).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limiter: anyio.CapacityLimiter,
                 embeds_limits: EmbedsLimits | None, *,
                 decode_payload: PayloadDecoder = decode_prompt_embeds, image_spec: ImageSpec | None = None,
                 image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> None:
        self.image_spec = image_spec  # None: the model takes no images
        self.image_limits = image_limits
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limiter = limiter
        self.embeds_limits = embeds_limits  # None: prompt embeddings are refused
        self.decode_payload = decode_payload

    async def render(self, prompts: Sequence[Prompt]) -> list[EngineInput]:
        """Render every prompt concurrently; results in input order.

        The first bad prompt (by input position) is raised and the others are
        cancelled. Cancellation cancels every prompt still rendering (a decode
        already running in a thread finishes first and its result is dropped).
        """
        return await gather_first_failure([partial(self.render_one, prompt) for prompt in prompts])

    async def render_one(self, prompt: Prompt) -> EngineInput:
        """One prompt as engine input. Cancellation drops a worker thread's result once the
        thread returns (decoding is not interrupted)."""
        if isinstance(prompt, str):
            return EngineInput(prompt, await self.tokenize(prompt))
        if isinstance(prompt, torch.Tensor):
            return await self._embeds_input(prompt)
        if isinstance(prompt, Mapping):
            return await self._render_mapping(prompt)
        if isinstance(prompt, Sequence):  # token ids (text was taken above)
            return EngineInput(None, self.check_token_ids(cast(Sequence[int], prompt)))
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompt")

    async def _render_mapping(self, prompt: Mapping[str, Any]) -> EngineInput:
        rendered = await self._render_mapping_prompt(prompt)
        salt = prompt.get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
            rendered.cache_salt = salt
        return rendered

    async def _render_mapping_prompt(self, prompt: Mapping[str, Any]) -> EngineInput:
        if prompt.get("prompt_embeds_parts"):
            return await self._with_embeds_parts(prompt.get("prompt_token_ids") or [], prompt["prompt_embeds_parts"])
        if prompt.get("multi_modal_data"):
            return await self._with_images(await self._render_text_or_ids(prompt), prompt["multi_modal_data"])
        if prompt.get("prompt_embeds") is not None:
            return await self._embeds_input(prompt["prompt_embeds"])
        return await self._render_text_or_ids(prompt)

    async def _with_images(self, rendered: EngineInput, data: Any) -> EngineInput:
        """Expand the prompt's image placeholders; all its images load and preprocess in one
        worker-thread call. Cancellation drops the thread's result once it returns."""
        spec = self.image_spec
        if spec is None:
            raise InvalidRequestError("this model does not take images", param="messages")
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            raise InvalidRequestError("multi_modal_data takes only 'image' (an image or a list of them)",
                                      param="multi_modal_data")
        sources = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        images = await anyio.to_thread.run_sync(process_images, list(sources), spec, self.image_limits,
                                                limiter=self.limiter)
        rendered.token_ids, rendered.mm_features = expand_placeholders(rendered.token_ids, images, spec)
        return rendered

    async def _render_text_or_ids(self, prompt: Mapping[str, Any]) -> EngineInput:
        if prompt.get("prompt_embeds") is not None:
            return await self._embeds_input(prompt["prompt_embeds"])
        if prompt.get("prompt_token_ids") is not None:
            ids = self.check_token_ids(prompt["prompt_token_ids"])
            types = prompt.get("token_type_ids")
            if types is not None and (len(types) != len(ids) or any(t not in (0, 1) for t in types)):
                raise InvalidRequestError("token_type_ids must be 0 or 1, one per token", param="token_type_ids")
            return EngineInput(prompt.get("prompt"), ids, token_type_ids=None if types is None else list(types))
        if isinstance(prompt.get("prompt"), str):
            return EngineInput(prompt["prompt"], await self.tokenize(prompt["prompt"]))
        raise InvalidRequestError("a prompt mapping needs 'prompt' (text), 'prompt_token_ids' or 'prompt_embeds'",
                                  param="prompt")

    async def _with_embeds_parts(self, token_ids: Sequence[int], parts: Sequence[tuple[int, Any]]) -> EngineInput:
        """Token ids with embedding rows inserted: each part `(position in token_ids, payload)` puts
        its rows before that token (a chat's prompt_embeds content parts). Payloads decode
        concurrently in worker threads; cancellation drops their results once the threads return."""
        ids = self.check_token_ids(token_ids, allow_empty=True)
        decoded = await gather_first_failure([partial(self.decode_embeds, payload) for _, payload in parts])
        out: list[int] = []
        spans = []
        cursor = 0
        for (position, _), rows in zip(parts, decoded, strict=True):
            if not cursor <= position <= len(ids):
                raise InvalidRequestError("prompt_embeds_parts positions must be in order within the prompt",
                                          param="prompt_embeds")
            out += ids[cursor:position]
            spans.append((len(out), int(rows.shape[0])))
            out += [0] * rows.shape[0]
            cursor = position
        out += ids[cursor:]
        embeds = torch.cat([rows.to(decoded[0].dtype) for rows in decoded])
        return EngineInput(None, out, embeds, embeds_spans=tuple(spans))

    async def _embeds_input(self, payload: Any) -> EngineInput:
        embeds = await self.decode_embeds(payload)
        return EngineInput(None, [0] * embeds.shape[0], embeds)

    async def decode_embeds(self, payload: Any) -> torch.Tensor:
        """A validated `(rows, hidden)` tensor from a tensor or a base64 `torch.save` payload.

        Decoding runs in a worker thread; cancellation drops its result once the thread returns.
        """
        limits = self.embeds_limits
        if limits is None:
            raise InvalidRequestError(EMBEDS_DISABLED, param="prompt_embeds")
        if isinstance(payload, (str, bytes, bytearray, memoryview)):
            return await anyio.to_thread.run_sync(self.decode_payload, payload, limits, limiter=self.limiter)
        size = payload.numel() * payload.element_size() if isinstance(payload, torch.Tensor) else 0
        return await run_sized(check_prompt_embeds, payload, limits, size=size, inline_below=INLINE_TENSOR_BYTES,
                               limiter=self.limiter)

    async def refuse_if_too_long(self, text: str, limit: int) -> None:
        """Raise the context-length error when `text` surely has `limit` tokens or more, judged by
        tokenizing a prefix only (see PROBE_CHARS_PER_TOKEN); otherwise return, and the caller
        tokenizes it as usual. The prefix is tokenized in a worker thread when long; cancellation
        drops its result once the thread returns."""
        probe_chars = PROBE_CHARS_PER_TOKEN * limit
        if len(text) <= probe_chars:
            return
        ids = await run_sized(self.tokenizer.encode, text[:probe_chars], False, size=probe_chars,
                              inline_below=INLINE_TOKENIZE_CHARS, limiter=self.limiter)
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has more than "
                f"{len(ids)} input tokens (the first {probe_chars} of its {len(text)} characters hold {len(ids)}). "
                "Please reduce the length of the input prompt.", param="prompt")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; long texts are tokenized in a worker thread. Empty text is an error.

        Cancellation drops a worker thread's result once the thread returns.
        """
        ids = await run_sized(self.tokenizer.encode, text, add_special_tokens, size=len(text),
                              inline_below=INLINE_TOKENIZE_CHARS, limiter=self.limiter)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def check_token_ids(self, token_ids: Sequence[int], allow_empty: bool = False) -> list[int]:
        ids = list(token_ids)
        if not ids and not allow_empty:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is out of vocabulary (size {vocab})", param="prompt")
        return ids
