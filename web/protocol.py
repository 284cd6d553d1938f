"""OpenAI request bodies, validated by pydantic (pydantic-core parses the JSON bytes directly).

Fields a model does not declare are kept aside (`model_extra`) for `web.fields`
to refuse or, with `--allow-unknown-fields`, to log: nothing is ignored
silently. Conversion to `SamplingParams` turns every invalid value into a
400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.api import InvalidRequestError, RequestOutputKind, SamplingParams
from engine.structured_outputs import StructuredOutputs
from web.embeds_body import split_prompt_embeds
from web.errors import APIError, bad_request


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Nested(BaseModel):
    """A nested object whose keys nobody else defines: an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`, OpenAI's shape."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` object; one constraint at most (checked by StructuredOutputs).
    Keys it does not define are refused naming them (`_from_structured_outputs`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


class _Sampling(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's field: requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0  # with --scheduling-policy priority: lower runs first (vLLM's meaning)
    prompt_logprobs: int | None = Field(default=None, ge=0)  # top-N logprobs of every prompt token
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the answer
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    # Structured outputs, in the three spellings clients use: OpenAI's response_format, vLLM's
    # structured_outputs object, and vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None  # vLLM's: these tokens' logprobs instead of the top N
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end truncate_prompt_tokens cuts
    # OpenAI's tags for a request (up to 16 string pairs): accepted and not used, as vLLM accepts them
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # vLLM's beam search: `n` beams, scored by cumulative logprob / length ** length_penalty;
    # early_stopping as Hugging Face's (true, false or "never"). web/beam_search_api.py.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    def structured(self) -> StructuredOutputs | None:
        """The request's structured outputs, from whichever spelling it used (one at most)."""
        given = []
        if self.response_format is not None:
            spec = _from_response_format(self.response_format)
            if spec is not None:
                given.append(("response_format", spec))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", _from_structured_outputs(self.structured_outputs)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, _structured(name, **{kind: tuple(value) if kind == "choice" else value})))
        if len(given) > 1:
            raise bad_request(f"give one way to constrain the output, not {' and '.join(n for n, _ in given)}",
                              given[1][0])
        return given[0][1] if given else None

    def salted(self, prompt: str | list[int] | dict[str, Any]) -> str | list[int] | dict[str, Any]:
        """`prompt` as the engine takes it, carrying this request's `cache_salt` if it has one."""
        if self.cache_salt is None:
            return prompt
        if isinstance(prompt, dict):
            return {**prompt, "cache_salt": self.cache_salt}
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        return {key: prompt, "cache_salt": self.cache_salt}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, kind: RequestOutputKind,
                        prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's sampling parameters; fields it leaves unset take `defaults` (the model's
        generation config), then SamplingParams' own."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        values: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop or (), "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "max_tokens": max_tokens,
            "logprobs": logprobs, "output_kind": kind,
            "prompt_logprobs": max((v for v in (prompt_logprobs, self.prompt_logprobs) if v is not None),
                                   default=None),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": self.structured(),
            "logit_bias": self._logit_bias(), "allowed_token_ids": self.allowed_token_ids,
            "logprob_token_ids": self.logprob_token_ids,
            "bad_words": tuple(self.bad_words or ()), "truncate_prompt_tokens": self.truncate_prompt_tokens,
        }
        if self.truncation_side is not None:
            values["truncation_side"] = self.truncation_side
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
            elif defaults and name in defaults:
                values[name] = defaults[name]
        try:
            return SamplingParams(**values)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from exc


def _structured(param: str, **values: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**values)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param) from exc


def _from_response_format(value: ResponseFormat) -> StructuredOutputs | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return _structured("response_format", json_object=True)
    schema = value.json_schema.schema_ if value.json_schema is not None else None
    if schema is None:
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return _structured("response_format", json=schema)


_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}


def _from_structured_outputs(value: StructuredOutputsBody) -> StructuredOutputs:
    unknown = sorted(value.model_extra or ())
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported; supported: "
                          f"{', '.join(sorted(_STRUCTURED_KEYS))}", "structured_outputs")
    values = {k: v for k, v in value.model_dump(by_alias=True, exclude_none=True).items()}
    if "choice" in values:
        values["choice"] = tuple(values["choice"])
    return _structured("structured_outputs", **values)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # base64 of torch.save files (--enable-prompt-embeds). `parse_body` replaces large ones with
    # memoryviews on the body after validation (assignment is not validated).
    prompt_embeds: str | list[str] | None = None
    prompt_token_ids: list[int] | list[list[int]] | None = None  # token in (with prompt "" or absent)
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    def prompts(self) -> list[str | list[int] | dict[str, str]]:
        """Every prompt of the request: embeddings payloads first, then `prompt`'s (as vLLM orders them)."""
        if self.prompt is None and self.prompt_embeds is None and self.prompt_token_ids is None:
            raise bad_request("either prompt, prompt_token_ids or prompt_embeds is required", "prompt")
        embeds = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else list(self.prompt_embeds or ())
        if embeds and self.echo:
            raise bad_request("echo is not supported with prompt_embeds (the prompt has no text)", "echo")
        return [{"prompt_embeds": e} for e in embeds] + self._token_or_text_prompts()

    def _token_or_text_prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if self.prompt_token_ids is not None:  # token in, token out: `prompt` absent or ""
            if p not in (None, ""):
                raise bad_request("give prompt or prompt_token_ids, not both", "prompt_token_ids")
            ids = self.prompt_token_ids
            if not ids:
                raise bad_request("prompt_token_ids must not be empty", "prompt_token_ids")
            return _as_prompt_list(ids)
        if p is None or (p == "" and self.prompt_embeds is not None):
            return []  # the openai client cannot omit `prompt`; vLLM's documented form sends ""
        return _as_prompt_list(p)


class _ChatTemplating(_Body):
    """The fields that shape how `messages` are rendered (chat, tokenize, render, batch)."""

    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    continue_final_message: bool = False  # the prompt ends inside the final (assistant) message
    chat_template: str | None = None  # only with --trust-request-chat-template
    add_generation_prompt: bool = True

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs`, minus the names the server itself passes to the template."""
        extra = dict(self.chat_template_kwargs or {})
        taken = sorted(set(extra) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {taken[0]!r} (the server passes it)",
                              "chat_template_kwargs")
        return extra


def checked_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, with content a string or a list of `text`, `image_url` and `prompt_embeds`
    parts (the engine renders the parts; a model without vision refuses images, a server without
    --enable-prompt-embeds refuses embeddings)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "image_url", "prompt_embeds"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"messages[{i}]: unsupported content part {kind!r}; supported: text, "
                                      "image_url, prompt_embeds", "messages")
        elif content is None:
            message = {**message, "content": ""}
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts", "messages")
        out.append(message)
    return out


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text of every message (string contents and text parts), in order."""
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part["text"] for part in content
                      if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)]
    return texts


def echoed_text(messages: list[dict[str, Any]], echo: bool) -> str:
    """With `echo`: the final message's text when the assistant wrote it (the reply continues it)."""
    final = messages[-1] if messages else {}
    content = final.get("content") if isinstance(final, dict) else None
    return content if echo and final.get("role") == "assistant" and isinstance(content, str) else ""


class _ChatSampling(_Sampling, _ChatTemplating):
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # the reply starts with the final message's text when it is the assistant's
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    # OpenAI's reasoning effort: the chat template reads it as `reasoning_effort` (gpt-oss's does), as in
    # vLLM; a template that does not read it renders as without it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        extra = super().template_kwargs()
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        return extra


class ChatCompletionRequest(_ChatSampling):
    messages: list[dict[str, Any]]

    def echoed_text(self) -> str:
        return echoed_text(self.messages, self.echo)

    def checked_messages(self) -> list[dict[str, Any]]:
        return checked_messages(self.messages)


class BatchChatCompletionRequest(_ChatSampling):
    """/v1/chat/completions/batch: one conversation per item of `messages`, one choice each."""

    messages: list[list[dict[str, Any]]]


class TokenizeRequest(_ChatTemplating):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # the tokens' strings beside their ids


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _as_prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list of prompts: a text, token ids, texts, or token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [cast(list[int], value)]  # one prompt of token ids
    return list(cast(list[str] | list[list[int]], value))


# Fields whose type is a union: pydantic reports the first member's complaint, which misleads.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "prompt_embeds": "a base64 string or a list of base64 strings",
    "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
}


# Below this, a body's prompt_embeds are parsed the ordinary way (it costs less than a millisecond).
SPLIT_EMBEDS_BYTES = 1 << 20


def parse_body(model: type[_Body], body: bytes | bytearray, *, split_embeds_bytes: int = SPLIT_EMBEDS_BYTES) -> Any:
    """Validate JSON bytes into `model`; a 400 naming the first bad field otherwise.

    Large `prompt_embeds` payloads (bodies of `split_embeds_bytes` or more) are
    taken out of the body first and kept as views on it (see
    `web.embeds_body`), so no multi-megabyte string is built.
    """
    if "prompt_embeds" in model.model_fields and len(body) >= split_embeds_bytes:
        split = split_prompt_embeds(body)
        if split is not None:
            skeleton, payloads = split
            parsed = _validate(model, skeleton)
            parsed.prompt_embeds = payloads
            return parsed
    return _validate(model, body)


def _union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _validate(model: type[_Body], body: bytes | bytearray) -> Any:
    if not body:
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        # a union's member tags ("str", "dict[str,any]") say which branch failed, not where
        where = ".".join(str(p) for p in first.get("loc", ()) if not _union_tag(p)) or "body"
        kind: Literal["json_invalid"] | str = first.get("type", "")
        if kind == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first.get('msg')}") from exc
        field_name = where.split(".")[0]
        if field_name in _UNION_FIELDS and first.get("type") != "missing":
            raise bad_request(f"{field_name} must be {_UNION_FIELDS[field_name]}", field_name) from exc
        raise bad_request(f"{where}: {first.get('msg')}", field_name) from exc


def check_model(requested: str | None, served: set[str]) -> None:
    if requested is not None and requested not in served:
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


# ---- pooling -------------------------------------------------------------------------------------
def _checked_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Every input: a text or a list of token ids. Empty lists and empty strings are 400s."""
    items = _as_prompt_list(value)
    if not items:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(items):
        if not item:
            raise bad_request(f"input[{i}] is empty", "input")
    return items

class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None  # vLLM's chat-style input: the rendered conversation is embedded
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"  # base64 and bytes
    endianness: Literal["native", "big", "little"] = "native"  # base64 and bytes
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    normalize: bool | None = None  # L2-normalise (default: as the model's pooling config says)
    use_activation: bool | None = None  # vLLM's newer name for normalize
    # vLLM's: "max_length" pads every input with the pad token to the longest input the server takes
    # (for models trained at a fixed length without an attention mask); "do_not_pad" (default) does not.
    padding: Literal["max_length", "do_not_pad"] | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Every input: a text or a list of token ids. Empty lists and empty strings are 400s."""
        if (self.input is None) == (self.messages is None):
            raise bad_request("give exactly one of input or messages", "input")
        if self.input is None:
            return []  # the caller renders the messages
        return _checked_inputs(self.input)


class ClassificationRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    use_activation: bool | None = None  # probabilities (softmax / sigmoid; the default) or raw logits
    padding: Literal["max_length", "do_not_pad"] | None = None  # as EmbeddingRequest's
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return _checked_inputs(self.input)


class PoolingRequest(EmbeddingRequest):
    task: str = "embed"  # embed, token_embed or classify, as the model serves (the engine refuses others)


EmbeddingType = Literal["float", "binary", "ubinary", "base64"]


class CohereEmbedRequest(_Body):
    """`POST /v2/embed` (Cohere's Embed API v2, as vLLM takes it; web/cohere_embed.py)."""

    model: str | None = None
    texts: list[str] | None = None
    input_type: str | None = None
    output_dimension: int | None = None
    embedding_types: list[EmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class ScoreRequest(_Body):
    model: str | None = None
    # vLLM 0.32's names for the two sides (queries / items), and its older ones (text_1 / text_2,
    # data_1 / data_2); documents is what /rerank calls the second side.
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    score_type: Literal["embedding", "cross-encoder", "late-interaction"] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def pairs(self) -> tuple[list[str], list[str]]:
        """(queries, documents) of equal length: one query against many documents, or pairwise."""
        first = self._side(("queries", "text_1", "data_1"))
        second = self._side(("documents", "items", "text_2", "data_2"))
        if first is None or second is None:
            raise bad_request("score needs queries and items (or documents, text_1 and text_2, data_1 and data_2)",
                              "queries")
        firsts = [first] if isinstance(first, str) else list(first)
        seconds = [second] if isinstance(second, str) else list(second)
        if not firsts or not seconds:
            raise bad_request("queries and documents must not be empty", "documents")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise bad_request(f"{len(firsts)} queries and {len(seconds)} documents: give one query, or one "
                              "per document", "queries")
        for name, texts in (("queries", firsts), ("documents", seconds)):
            if any(not t for t in texts):
                raise bad_request(f"{name} must not contain empty strings", name)
        return firsts, seconds

    def _side(self, names: tuple[str, ...]) -> str | list[str] | None:
        """One side of the pairs, under whichever of its names the request used (one at most)."""
        given = [name for name in names if getattr(self, name) is not None]
        if len(given) > 1:
            raise bad_request(f"give one of {', '.join(names)}, not {' and '.join(given)}", given[1])
        value: str | list[str] | None = getattr(self, given[0]) if given else None
        return value


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    score_type: Literal["embedding", "cross-encoder", "late-interaction"] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


# ---- LoRA adapters at run time (web.lora_api) ----------------------------------------------------
class LoadLoRAAdapterRequest(_Body):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter of this name (its requests read the new weights)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's; the name decides
