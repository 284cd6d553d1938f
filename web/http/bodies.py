"""Request bodies: validated by pydantic (pydantic-core parses the JSON bytes directly), the
base classes every family's bodies derive from, and the 404 for a model not served.

Fields a body does not declare are kept aside (`model_extra`) for `web.http.fields` to refuse
or, with `--allow-unknown-fields`, to log: nothing is ignored silently. A bad value is a 400
naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from web.http.embeds_body import split_prompt_embeds
from web.http.errors import APIError, bad_request


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Nested(BaseModel):
    """A nested object whose keys nobody else defines: an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


def as_prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
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


def parse_body(model: type[Body], body: bytes | bytearray, *, split_embeds_bytes: int = SPLIT_EMBEDS_BYTES) -> Any:
    """Validate JSON bytes into `model`; a 400 naming the first bad field otherwise.

    Large `prompt_embeds` payloads (bodies of `split_embeds_bytes` or more) are
    taken out of the body first and kept as views on it (see
    `web.http.embeds_body`), so no multi-megabyte string is built.
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


def _validate(model: type[Body], body: bytes | bytearray) -> Any:
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
