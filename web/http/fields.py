"""Every request field of every endpoint: implemented, or refused with a reason.

A field the body declares is implemented. A field OpenAI or vLLM defines that trio-llm does not
implement is refused: a 400 naming it (`param`) with the reason, so a client never gets an
answer that silently ignored what it asked for. Each family declares its bodies' refused fields
beside the bodies (`declare_fields`). A field neither defines is refused too, unless the server
runs with `--allow-unknown-fields`: then it is logged and ignored, as vLLM logs them. A refused
field sent with an empty value (null, false, [], {}) asks for nothing and passes.

`docs/api.md` is generated from the declarations (`python -m web.fields > docs/api.md`); a test
checks that it is current.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from web.http.errors import bad_request

logger = logging.getLogger("trio_llm.requests")

# body class -> (its endpoint's name, its refused fields and why)
_DECLARED: dict[type[BaseModel], tuple[str, dict[str, str]]] = {}


def declare_fields(model: type[BaseModel], endpoint: str, refused: dict[str, str] | None = None) -> None:
    """`model` is the body of `endpoint` (a path under /v1, or "v2/..."), which refuses `refused`."""
    _DECLARED[model] = (endpoint, dict(refused or {}))


def declared() -> dict[str, tuple[type[BaseModel], dict[str, str]]]:
    """Every endpoint declared so far: its body and its refused fields."""
    return {endpoint: (model, refused) for model, (endpoint, refused) in _DECLARED.items()}


def path_of(endpoint: str) -> str:
    """The route of an endpoint named in the table (every one under /v1, but Cohere's /v2/embed)."""
    return f"/{endpoint}" if endpoint.startswith("v2/") else f"/v1/{endpoint}"


def _asks_for_something(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


NESTED_REFUSED: dict[str, dict[str, str]] = {"stream_options": {}, "response_format": {}}


def check_fields(parsed: BaseModel, allow_unknown: bool) -> None:
    """Refuse the fields of `parsed` that no one implements (see the module docstring)."""
    endpoint, refused = _DECLARED.get(type(parsed), ("", {}))
    _check(parsed.model_extra or {}, refused, endpoint, "", allow_unknown)
    for name, refused in NESTED_REFUSED.items():
        nested = getattr(parsed, name, None)
        if isinstance(nested, BaseModel):
            _check(nested.model_extra or {}, refused, endpoint, f"{name}.", allow_unknown)


def _check(extra: dict[str, Any], refused: dict[str, str], endpoint: str, prefix: str, allow_unknown: bool) -> None:
    for name, value in extra.items():
        if name in refused and _asks_for_something(value):
            raise bad_request(f"{prefix}{name} is not supported: {refused[name]}", prefix + name)
    unknown = sorted(prefix + name for name in extra if name not in refused)
    if not unknown:
        return
    if not allow_unknown:
        raise bad_request(f"Unknown field {unknown[0]!r} for {path_of(endpoint)} (start the server with "
                          "--allow-unknown-fields to ignore fields it does not know)", unknown[0])
    logger.warning("The following fields were present in the request but ignored: %s", set(unknown))
