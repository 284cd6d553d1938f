"""Grammars for structured outputs, with llguidance: compile (and validate) a request's
`StructuredOutputs` into an llguidance grammar, and the tokenizer llguidance masks with.

Compilation is blocking CPU work: `GrammarCompiler` runs it in a worker thread under the
renderer's limiter and caches results by the grammar's key, so a schema sent again costs a
dictionary lookup. Invalid schemas, regexes and grammars raise `InvalidRequestError` with
llguidance's message. JSON is compact by default (no free whitespace between tokens): a small
model left free to emit whitespace fills `max_tokens` with newlines and never closes the object.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import anyio
import llguidance

from engine.errors import InvalidRequestError
from engine.structured_outputs import StructuredOutputs

CACHE_SIZE = 256


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, `vocab_size` wide (the logits' width)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)


def grammar_text(spec: StructuredOutputs, max_integer_digits: int | None = None) -> str:
    """The llguidance grammar for `spec` (not yet checked against a tokenizer); a JSON schema's
    integers without bounds get `max_integer_digits` digits at most."""
    if spec.json_object or spec.json is not None:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                          param="structured_outputs") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be an object", param="structured_outputs")
        options = {"whitespace_flexible": spec.whitespace_flexible}
        if max_integer_digits is not None:
            schema = bounded_integers(schema, 10 ** max_integer_digits - 1)
        return llguidance.grammar_from("json_schema", json.dumps({**schema, "x-guidance": options}))
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def bounded_integers(schema: Any, largest: int) -> Any:
    """`schema` with every integer type that has no bound of its own held to +-`largest` (a model
    free to write digits writes hundreds). Subschemas anywhere (properties, items, $defs, anyOf,
    ...) are walked; everything else is kept as it is."""
    if isinstance(schema, list):
        return [bounded_integers(item, largest) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: value if key in ("enum", "const", "default", "examples") else bounded_integers(value, largest)
               for key, value in schema.items()}
    kind = schema.get("type")
    if (kind == "integer" or isinstance(kind, list) and "integer" in kind) and not any(b in schema for b in _BOUNDS):
        bounded.update(minimum=-largest, maximum=largest)
    return bounded


def compile_grammar(spec: StructuredOutputs, tokenizer: llguidance.LLTokenizer,
                    max_integer_digits: int | None = None) -> str:
    """`grammar_text` checked against the tokenizer; `InvalidRequestError` with llguidance's message."""
    try:
        text = grammar_text(spec, max_integer_digits)
    except ValueError as exc:
        raise InvalidRequestError(f"invalid structured outputs: {exc}", param="structured_outputs") from None
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise InvalidRequestError(f"invalid structured outputs: {error.strip()}", param="structured_outputs")
    return text


class GrammarCompiler:
    """Compiles off the event loop, one tokenizer per engine (built on first use), results cached."""

    def __init__(self, tokenizer_backend: Any, vocab_size: int, eos_token_id: int | None,
                 limiter: anyio.CapacityLimiter, max_integer_digits: int | None = 18) -> None:
        self._backend = tokenizer_backend  # a `tokenizers.Tokenizer`
        self._args = (vocab_size, eos_token_id)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._limiter = limiter
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._max_integer_digits = max_integer_digits

    async def compile(self, spec: StructuredOutputs) -> StructuredOutputs:
        """`spec` with its compiled grammar. Compiling runs in a worker thread; cancellation drops
        its result once the thread returns."""
        cached = self._cache.get(spec.key)
        if cached is None:
            cached = await anyio.to_thread.run_sync(self._compile, spec, limiter=self._limiter)
            self._cache[spec.key] = cached
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec.key)
        return replace(spec, compiled=cached)

    def _compile(self, spec: StructuredOutputs) -> str:
        if self._tokenizer is None:
            self._tokenizer = make_tokenizer(tokenizer_json_of(self._backend), *self._args)
        return compile_grammar(spec, self._tokenizer, self._max_integer_digits)


def tokenizer_json_of(backend: Any) -> str:
    """The JSON text of a `tokenizers.Tokenizer`."""
    text: str = backend.to_str()
    return text
