"""Pooling endpoints: /v1/embeddings, /pooling, /score, /rerank (also under /v1).

Every endpoint has the same shape:
init -> pre-process (validation, tokenization) in a worker thread under the
server's shared limiter -> one engine request per input (`engine.encode`:
results in input order; cancellation aborts every sibling) -> post-process
(scores, base64, the JSON body) in a worker thread. The loop only awaits,
so a batch of a thousand inputs never blocks it. Work below `INLINE_WORK`
(one short sentence) runs inline: there the thread hop costs more than the
work, and at 64 concurrent one-sentence requests the hops alone took a
fifth of the server's throughput.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from dataclasses import replace
from typing import Any

import torch
from pydantic_core import to_json
from quart import Response
from quart_trio import QuartTrio

from engine.api import AsyncEngine, PoolingParams, PoolingRequestOutput, Tokenizer
from engine.ids import random_id
from web.http.errors import bad_request
from web.http.requests import offload, read_request
from web.http.state import ServerState
from web.pooling.protocol import ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return await create_embeddings(state, await read_request(state, EmbeddingRequest))

    @app.post("/pooling")
    async def pooling() -> Response:
        return await create_embeddings(state, await read_request(state, PoolingRequest), object_name="pooling")

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify() -> Response:
        return await create_classification(state, await read_request(state, ClassificationRequest))

    @app.post("/score")
    @app.post("/v1/score")
    async def score() -> Response:
        return await create_score(state)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank() -> Response:
        return await create_rerank(state)


def _input_size(inputs: list[Any]) -> int:
    return sum(len(i) if isinstance(i, (str, list)) else 1 for i in inputs)


def _output_size(outputs: list[PoolingRequestOutput]) -> int:
    return sum(o.data.numel() for o in outputs)


def checked_truncation(engine: AsyncEngine, truncate: int | None) -> int | None:
    """`truncate_prompt_tokens` as given (-1: the model's limit), if it fits the model (vLLM's check
    and wording)."""
    max_len = engine.info.max_model_len
    if truncate == -1:
        return max_len
    if truncate is not None and truncate < 1:
        raise bad_request("truncate_prompt_tokens must be -1 (the model's limit) or at least 1",
                          "truncate_prompt_tokens")
    if truncate is not None and truncate > max_len:  # a pooling request generates nothing: max_tokens is 0
        raise bad_request(f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len - max_tokens = "
                          f"{max_len}. Please request a smaller truncation size.", "truncate_prompt_tokens")
    return truncate


# ---- pre-processing (worker threads) ------------------------------------------------------------
def tokenize_inputs(tokenizer: Tokenizer, inputs: list[str | list[int]], truncate: int | None) -> list[list[int]]:
    """Texts tokenized in one batch; token lists as given; both cut to `truncate` tokens if set."""
    texts = [i for i in inputs if isinstance(i, str)]
    if truncate is None:
        encoded = iter(tokenizer.encode_batch(texts))
    else:
        encoded = iter([tokenizer.encode_truncated(t, truncate) for t in texts])
    prompts = [next(encoded) if isinstance(i, str) else list(i) for i in inputs]
    return prompts if truncate is None else [p[:truncate] for p in prompts]


def padded(engine: AsyncEngine, prompts: list[list[int]], padding: str | None) -> list[list[int]]:
    """vLLM's `padding: "max_length"`: every input filled with the pad token up to the longest input
    the server takes (as the tokenizer pads); an input longer than that is left as is (the length
    limit answers it)."""
    if padding != "max_length":
        return prompts
    pad = engine.tokenizer.token_to_id(engine.tokenizer.pad_token)
    if pad is None:
        raise bad_request("padding max_length needs a pad token; this tokenizer has none", "padding")
    length = engine.pooling_input_limit
    return [p + [pad] * (length - len(p)) for p in prompts]


def activated(logits: torch.Tensor, use_activation: bool) -> torch.Tensor:
    """Classification logits as probabilities (softmax over the labels; a sigmoid for a single
    label), or as they are."""
    logits = logits.float()
    if not use_activation:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def tokenize_pairs(tokenizer: Tokenizer, firsts: list[str], seconds: list[str],
                   truncate: int | None) -> list[dict[str, list[int]]]:
    prompts = []
    for a, b in zip(firsts, seconds, strict=True):
        ids, types = tokenizer.encode_pair(a, b)
        if truncate is not None:
            ids, types = ids[:truncate], types[:truncate]
        prompts.append({"prompt_token_ids": ids, "token_type_ids": types})
    return prompts


# ---- embeddings and pooling ---------------------------------------------------------------------
async def create_embeddings(state: ServerState, req: EmbeddingRequest, object_name: str = "embedding") -> Response:
    """Handles `POST /v1/embeddings`. The client going away cancels the handler, which aborts its
    engine requests.
    """
    engine = state.engine_for_request()
    inputs = req.inputs()
    truncate = checked_truncation(engine, req.truncate_prompt_tokens)
    if req.messages is not None:  # the conversation as the chat template renders it
        rendered = await engine.chat_prompt(req.messages, add_generation_prompt=False)
        inputs = [rendered["prompt_token_ids"]]
    prompts = await offload(state, tokenize_inputs, engine.tokenizer, inputs, truncate, size=_input_size(inputs))
    task = getattr(req, "task", "embed")
    params = PoolingParams(task=task, dimensions=req.dimensions, normalize=req.normalize,
                            use_activation=req.use_activation)
    outputs = await engine.encode(padded(engine, prompts, req.padding), params)
    if task == "classify":  # /pooling with a classifier: probabilities unless use_activation is false
        use = engine.info.pooler.activation if req.use_activation is None else req.use_activation
        outputs = [replace(output, data=activated(output.data, use)) for output in outputs]
    if req.encoding_format in ("bytes", "bytes_only"):
        raw, headers = await offload(state, embeddings_bytes, outputs, req, state.model_name,
                                     size=_output_size(outputs))
        return Response(raw, content_type="application/octet-stream", headers=headers)
    body = await offload(state, embeddings_body, outputs, req, state.model_name, object_name,
                         size=_output_size(outputs))
    return Response(body, content_type="application/json")


async def create_classification(state: ServerState, req: ClassificationRequest) -> Response:
    """Handles `POST /classify`: the classification head's probabilities per input (softmax over
    the labels; a sigmoid for a single-label head; logits with `use_activation: false`), with the
    most likely label, as vLLM answers.
    The client going away cancels the handler, which aborts its engine requests."""
    engine = state.engine_for_request()
    inputs = req.inputs()
    truncate = checked_truncation(engine, req.truncate_prompt_tokens)
    prompts = await offload(state, tokenize_inputs, engine.tokenizer, inputs, truncate, size=_input_size(inputs))
    outputs = await engine.encode(padded(engine, prompts, req.padding), PoolingParams(task="classify"))
    labels = engine.info.labels
    use = engine.info.pooler.activation if req.use_activation is None else req.use_activation
    data = []
    for index, output in enumerate(outputs):
        probs = activated(output.data, use)
        best = int(probs.argmax())
        data.append({"index": index, "label": labels[best] if best < len(labels) else str(best),
                     "probs": probs.tolist(), "num_classes": probs.numel()})
    prompt_tokens = _tokens(outputs)
    body = {"id": f"classify-{random_id()}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}}
    return Response(json.dumps(body), content_type="application/json")


# vLLM's `embed_dtype` names: the dtype the vector is cast to, and the dtype its bytes are read as
# (numpy has no bfloat16 or fp8, so those travel as raw 16- and 8-bit words).
EMBED_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}


def vector_bytes(data: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    """The vector's bytes in `embed_dtype`, in the byte order asked for (vLLM's `tensor2binary`)."""
    dtype, word = EMBED_DTYPES[embed_dtype]
    array = data.to(dtype).flatten().contiguous().view(word).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def encode_vector(data: torch.Tensor, encoding_format: str, embed_dtype: str = "float32",
                  endianness: str = "native") -> Any:
    if encoding_format == "base64":  # float32 in native (little-endian) order, as the openai client decodes it
        return base64.b64encode(vector_bytes(data, embed_dtype, endianness)).decode()
    return data.tolist()


def embeddings_body(outputs: list[PoolingRequestOutput], req: EmbeddingRequest, model: str,
                    object_name: str) -> bytes:
    key = "embedding" if object_name == "embedding" else "data"
    data = [{"object": object_name, "index": i,
             key: encode_vector(o.data, req.encoding_format, req.embed_dtype, req.endianness)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return to_json({"id": f"embd-{random_id()}", "object": "list", "created": int(time.time()),
                    "model": model, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def embeddings_bytes(outputs: list[PoolingRequestOutput], req: EmbeddingRequest,
                     model: str) -> tuple[bytes, dict[str, str]]:
    """`encoding_format` "bytes": the vectors back to back as the body, and where each lies in a
    `metadata` header (JSON: id, created, model, data, usage), as vLLM answers; "bytes_only"
    leaves the header out."""
    chunks, items, offset = [], [], 0
    for index, output in enumerate(outputs):
        chunk = vector_bytes(output.data, req.embed_dtype, req.endianness)
        items.append({"index": index, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                      "start": offset, "end": offset + len(chunk), "shape": list(output.data.shape)})
        chunks.append(chunk)
        offset += len(chunk)
    if req.encoding_format == "bytes_only":
        return b"".join(chunks), {}
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    metadata = {"id": f"embd-{random_id()}", "created": int(time.time()), "model": model, "data": items,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return b"".join(chunks), {"metadata": json.dumps(metadata)}


# ---- score and rerank ---------------------------------------------------------------------------
def score_type_for(engine: AsyncEngine, requested: str | None) -> str:
    """A cross-encoder scores pairs with its head; a late-interaction (ColBERT) model by MaxSim over
    token embeddings; other models by the cosine of their embeddings, or MaxSim when asked."""
    cross, late = "classify" in engine.pooling_tasks, engine.info.pooler.late_interaction
    kind = requested or ("cross-encoder" if cross else "late-interaction" if late else "embedding")
    if (kind == "cross-encoder") != cross:
        reason = ("has no classification head: it cannot score as a cross-encoder" if not cross
                  else "is a cross-encoder: it scores pairs with its classification head")
        raise bad_request(f"this model {reason}", "score_type")
    if late and kind != "late-interaction":
        raise bad_request("this model is a late-interaction model: it scores by MaxSim over token embeddings",
                          "score_type")
    return kind


async def compute_scores(state: ServerState, engine: AsyncEngine, firsts: list[str], seconds: list[str],
                         score_type: str | None, truncate: int | None) -> tuple[list[float], int]:
    """One score per (first, second) pair, and the prompt tokens used.

    Cancellation aborts the engine requests still running.
    """
    kind = score_type_for(engine, score_type)
    truncate = checked_truncation(engine, truncate)
    if kind == "cross-encoder":
        prompts = await offload(state, tokenize_pairs, engine.tokenizer, firsts, seconds, truncate,
                                size=_input_size(firsts + seconds))
        outputs = await engine.encode(prompts, PoolingParams(task="classify"))
        return await offload(state, cross_encoder_scores, outputs, size=len(outputs)), _tokens(outputs)
    # Each distinct text is encoded once: a query shared by many documents is pooled one time and
    # kept (here, for this request) until the last document's score is computed.
    distinct = list(dict.fromkeys(firsts + seconds))
    prompts = await offload(state, tokenize_inputs, engine.tokenizer, distinct, truncate, size=_input_size(distinct))
    task = "token_embed" if kind == "late-interaction" else "embed"
    outputs = await engine.encode(prompts, PoolingParams(task=task))
    by_text = {text: out.data for text, out in zip(distinct, outputs, strict=True)}
    measure = max_sim if kind == "late-interaction" else cosine
    pairs = list(zip(firsts, seconds, strict=True))
    scores = await offload(state, lambda: [measure(by_text[a], by_text[b]) for a, b in pairs],
                           size=_output_size(outputs))
    return scores, _tokens(outputs)


def _tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


def cross_encoder_scores(outputs: list[PoolingRequestOutput]) -> list[float]:
    """One label: its sigmoid (as sentence-transformers' CrossEncoder); several: the softmax of the last."""
    return [float(torch.sigmoid(o.data[0]) if o.data.numel() == 1 else torch.softmax(o.data, -1)[-1])
            for o in outputs]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def max_sim(query: torch.Tensor, document: torch.Tensor) -> float:
    """Late interaction (ColBERT MaxSim): for each query token, its best dot product over the
    document's tokens; summed. In float32."""
    return float((query.float() @ document.float().T).max(dim=1).values.sum())


async def create_score(state: ServerState) -> Response:
    """Handles `POST /score`. The client going away cancels the handler, which aborts its engine
    requests.
    """
    req: ScoreRequest = await read_request(state, ScoreRequest)
    engine = state.engine_for_request()
    firsts, seconds = req.pairs()
    scores, tokens = await compute_scores(state, engine, firsts, seconds, req.score_type, req.truncate_prompt_tokens)
    body = {"id": f"score-{random_id()}", "object": "list", "created": int(time.time()),
            "model": state.model_name, "data": [{"index": i, "object": "score", "score": s}
                                                for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Response(await offload(state, to_json, body, size=len(scores) * 8), content_type="application/json")


async def create_rerank(state: ServerState) -> Response:
    """Handles `POST /rerank`. The client going away cancels the handler, which aborts its engine
    requests.
    """
    req: RerankRequest = await read_request(state, RerankRequest)
    engine = state.engine_for_request()
    if not req.documents or any(not d for d in req.documents):
        raise bad_request("documents must be a non-empty list of non-empty strings", "documents")
    if not req.query:
        raise bad_request("query must not be empty", "query")
    scores, tokens = await compute_scores(state, engine, [req.query] * len(req.documents), req.documents,
                                          req.score_type, req.truncate_prompt_tokens)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:req.top_n or len(scores)]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": req.documents[i]}}
                                                              if req.return_documents else {})} for i in order]
    body = {"id": f"rerank-{random_id()}", "model": state.model_name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Response(await offload(state, to_json, body, size=len(results) * 8), content_type="application/json")
