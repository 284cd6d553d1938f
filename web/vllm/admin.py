"""Health, version, models, tokenize/detokenize and Prometheus metrics."""

from __future__ import annotations

import json
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import anyio
from pydantic_core import to_json
from quart import Response
from quart_trio import QuartTrio

from web.chat.run import chat_prompt_for
from web.chat.tools import template_tools
from web.http.errors import APIError, bad_request
from web.http.requests import read_request
from web.http.state import ServerState
from web.vllm.protocol import DetokenizeRequest, TokenizeRequest

_STARTED = int(time.time())


def _json(payload: object, status: int = 200) -> Response:
    return Response(to_json(payload), status=status, content_type="application/json")


def _version() -> str:
    try:
        return version("trio-llm")
    except PackageNotFoundError:
        return "unknown"


def register(app: QuartTrio, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return await serve_health(state)

    @app.route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await serve_ping(state)

    @app.get("/version")
    async def get_version() -> Response:
        return await serve_version(state)

    @app.get("/v1/models")
    async def models() -> Response:
        return await serve_models(state)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return await serve_tokenize(state)

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return await serve_detokenize(state)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return await serve_tokenizer_info(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await serve_metrics(state)


async def serve_health(state: ServerState) -> Response:
    """`GET /health`: 200 while the engine serves, 503 once it has failed. Cancellation: nothing runs."""
    return Response(b"", status=200 if state.engine_alive else 503)


async def serve_ping(state: ServerState) -> Response:
    """`GET`/`POST /ping`, vLLM's (SageMaker's) liveness probe: as /health. Cancellation: nothing runs."""
    return await serve_health(state)


async def serve_version(state: ServerState) -> Response:
    """`GET /version`: the installed package's version. Cancellation: nothing runs."""
    return _json({"version": _version()})


async def serve_models(state: ServerState) -> Response:
    """`GET /v1/models`: the served model, and each LoRA adapter as a model whose parent is the base
    (as vLLM lists them). Cancellation: nothing runs."""
    max_len = state.engine.info.max_model_len if state.engine else None
    card = {"id": state.model_name, "object": "model", "created": _STARTED, "owned_by": "trio-llm",
            "root": state.engine_config.model, "parent": None, "max_model_len": max_len}
    # Each LoRA adapter is a model of its own whose parent is the base, as vLLM lists them.
    loras = state.engine.loras if state.engine else ()
    adapters = [{"id": lora.lora_name, "object": "model", "created": _STARTED, "owned_by": "trio-llm",
                 "root": lora.lora_path, "parent": lora.base_model_name or state.model_name,
                 "max_model_len": max_len} for lora in loras]
    return _json({"object": "list", "data": [card, *adapters]})


async def serve_tokenize(state: ServerState) -> Response:
    """`POST /tokenize`: a prompt's or a conversation's token ids (rendered as the chat endpoint renders
    it, tools included). Cancellation stops the tokenizing (a thread's result is dropped)."""
    req: TokenizeRequest = await read_request(state, TokenizeRequest)
    engine = state.engine_for_request()
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if req.messages is not None:  # as the chat endpoint renders them, tools included
        rendered = await chat_prompt_for(state, engine, req, req.messages, template_tools(req.tools))
        tokens = rendered["prompt_token_ids"]
    else:
        tokens = await engine.tokenize(req.prompt, req.add_special_tokens) if req.prompt else []
    body: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens,
                            "token_strs": None}  # vLLM's answer always carries the key
    if req.return_token_strs:
        body["token_strs"] = [engine.tokenizer.id_to_token(t) for t in tokens]
    return _json(body)


async def serve_detokenize(state: ServerState) -> Response:
    """`POST /detokenize`: the text of token ids. Cancellation: the body's reading stops."""
    req: DetokenizeRequest = await read_request(state, DetokenizeRequest)
    engine = state.engine_for_request()
    return _json({"prompt": engine.detokenize(req.tokens)})


async def serve_tokenizer_info(state: ServerState) -> Response:
    """`GET /tokenizer_info` (--enable-tokenizer-info-endpoint): the tokenizer's configuration
    (tokenizer_config.json) and its special tokens, as vLLM serves them. Cancellation stops the
    file's reading."""
    if not state.settings.enable_tokenizer_info_endpoint:
        raise APIError(404, "/tokenizer_info is off; start the server with --enable-tokenizer-info-endpoint")
    engine = state.engine_for_request()
    path = Path(engine.config.tokenizer_path) / "tokenizer_config.json"
    config = json.loads(await anyio.Path(path).read_text()) if path.is_file() else {}
    tok = engine.tokenizer
    return _json({**config, "tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
                  "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                  "model_max_length": engine.info.max_model_len, "vocab_size": tok.vocab_size})


async def serve_metrics(state: ServerState) -> Response:
    """`GET /metrics`: Prometheus's text format. Cancellation: nothing runs."""
    return Response(state.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")
