"""`POST /v2/embed`: Cohere's Embed API (v2) as vLLM serves it, on the embeddings path.

Texts are embedded as `/v1/embeddings` embeds them; `input_type` selects a prompt prefix from
the model's own configuration (`task_instructions` in config.json, else `prompts` in
config_sentence_transformers.json; a model with neither refuses every input_type); `truncate`
says which end of an over-long input is cut (NONE: refused when over `max_tokens`);
`embedding_types` asks for float vectors, base64 of little-endian float32, or sign bits packed
eight to a byte (`binary` signed, `ubinary` unsigned), in Cohere's by-type response.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import torch
from quart import Response
from quart_trio import QuartTrio

from engine.api import AsyncEngine, PoolingParams, Tokenizer
from engine.ids import random_id
from web.http.errors import bad_request
from web.http.requests import offload, read_request
from web.http.state import ServerState
from web.pooling.handlers import checked_truncation
from web.pooling.protocol import CohereEmbedRequest


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v2/embed")
    async def cohere_embed() -> Response:
        return await create_cohere_embedding(state, await read_request(state, CohereEmbedRequest))


async def create_cohere_embedding(state: ServerState, req: CohereEmbedRequest) -> Response:
    """Embed `texts` and answer in Cohere's shape. The client going away cancels the handler,
    which aborts its engine requests."""
    engine = state.engine_for_request()
    if not req.texts:
        raise bad_request("texts must hold at least one text (images and inputs are not served)", "texts")
    prefix = input_type_prefix(engine, req.input_type)
    texts = [prefix + text for text in req.texts]
    size = sum(len(t) for t in texts)
    prompts = await offload(state, truncated_inputs, engine.tokenizer, texts, req.truncate,
                            checked_truncation(engine, req.max_tokens or -1), size=size)
    if req.truncate == "NONE" and req.max_tokens is not None:
        longest = max(len(p) for p in prompts)
        if longest > req.max_tokens:
            raise bad_request(f"Input of {longest} tokens exceeds max_tokens={req.max_tokens} with truncate=NONE. "
                              "Set truncate to END or START to allow truncation.", "max_tokens")
    outputs = await engine.encode(prompts, PoolingParams(task="embed", dimensions=req.output_dimension),
                                  priority=req.priority)
    vectors = [output.data.float() for output in outputs]
    body = {"id": f"embd-{random_id()}",
            "embeddings": await offload(state, typed_embeddings, vectors, req.embedding_types or ["float"],
                                        size=sum(v.numel() for v in vectors)),
            "texts": list(req.texts),
            "meta": {"api_version": {"version": "2"},
                     "tokens": {"input_tokens": sum(len(o.prompt_token_ids) for o in outputs)}}}
    return Response(json.dumps(body), content_type="application/json")


def truncated_inputs(tokenizer: Tokenizer, texts: list[str], truncate: str, keep: int | None) -> list[list[int]]:
    """Token ids of each text; over `keep` tokens, END keeps the first and START the last."""
    prompts = tokenizer.encode_batch(texts)
    if truncate == "NONE" or keep is None:
        return prompts
    return [p[-keep:] if truncate == "START" else p[:keep] for p in prompts]


_PREFIXES: dict[str, dict[str, str]] = {}


def input_type_prefix(engine: AsyncEngine, input_type: str | None) -> str:
    """The prompt prefix the model's configuration gives `input_type` (none: no prefix)."""
    if input_type is None:
        return ""
    model_dir = engine.config.model
    if model_dir not in _PREFIXES:
        _PREFIXES[model_dir] = read_prefixes(Path(model_dir))
    prefixes = _PREFIXES[model_dir]
    if not prefixes:
        raise bad_request(f"Unsupported input_type {input_type!r}. This model does not define any input_type "
                          "prompt prefixes.", "input_type")
    if input_type not in prefixes:
        raise bad_request(f"Unsupported input_type {input_type!r}. Supported values: {', '.join(sorted(prefixes))}",
                          "input_type")
    return prefixes[input_type]


def read_prefixes(model_dir: Path) -> dict[str, str]:
    """`task_instructions` of config.json, else `prompts` of config_sentence_transformers.json."""
    for name, key in (("config.json", "task_instructions"), ("config_sentence_transformers.json", "prompts")):
        try:
            found = json.loads((model_dir / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, dict) and found:
            return {k: v for k, v in found.items() if isinstance(v, str)}
    return {}


def typed_embeddings(vectors: list[torch.Tensor], types: list[str]) -> dict[str, Any]:
    """Cohere's `embeddings` object: one list per requested type."""
    out: dict[str, Any] = {}
    for kind in types:
        if kind == "float":
            out["float"] = [v.tolist() for v in vectors]
        elif kind == "base64":
            out["base64"] = [base64.b64encode(struct.pack(f"<{v.numel()}f", *v.tolist())).decode() for v in vectors]
        else:
            out[kind] = [packed_signs(v, signed=kind == "binary") for v in vectors]
    return out


def packed_signs(vector: torch.Tensor, signed: bool) -> list[int]:
    """One bit per dimension (1: non-negative), eight to a byte, first dimension in the high bit;
    `signed` shifts each byte by -128 (Cohere's int8 `binary`)."""
    if vector.numel() % 8:
        raise bad_request(f"binary embedding types need a dimension divisible by 8, got {vector.numel()}",
                          "embedding_types")
    bits = (vector >= 0).to(torch.int64).reshape(-1, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1])
    packed = (bits * weights).sum(dim=1)
    return (packed - 128 if signed else packed).tolist()
