"""The bodies of the pooling endpoints: embeddings, pooling, classify, score, rerank and
Cohere's /v2/embed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from web.http.bodies import Body, as_prompt_list
from web.http.errors import bad_request
from web.http.fields import declare_fields


def _checked_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """Every input: a text or a list of token ids. Empty lists and empty strings are 400s."""
    items = as_prompt_list(value)
    if not items:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(items):
        if not item:
            raise bad_request(f"input[{i}] is empty", "input")
    return items

class EmbeddingRequest(Body):
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


class ClassificationRequest(Body):
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


class CohereEmbedRequest(Body):
    """`POST /v2/embed` (Cohere's Embed API v2, as vLLM takes it; web/pooling/cohere.py)."""

    model: str | None = None
    texts: list[str] | None = None
    input_type: str | None = None
    output_dimension: int | None = None
    embedding_types: list[EmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class ScoreRequest(Body):
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


class RerankRequest(Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    score_type: Literal["embedding", "cross-encoder", "late-interaction"] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


declare_fields(EmbeddingRequest, "embeddings",
               {"priority": "request priorities are not taken from the API for pooling"})
declare_fields(PoolingRequest, "pooling")
declare_fields(ClassificationRequest, "classify")
declare_fields(ScoreRequest, "score")
declare_fields(RerankRequest, "rerank")
declare_fields(CohereEmbedRequest, "v2/embed", {
    "images": "images are not embedded (no image embedding model is served)",
    "inputs": "mixed text and image inputs are not embedded; send texts",
})
