"""docs/api.md: per endpoint, the fields implemented and those refused, with reasons, from what
each family declares beside its bodies (`web.http.fields`).

`python -m web.fields > docs/api.md`; a test checks that it is current.
"""

from __future__ import annotations

from pydantic import BaseModel

from web.anthropic import protocol as anthropic_protocol
from web.chat import protocol as chat_protocol
from web.http.fields import NESTED_REFUSED, declared, path_of
from web.openai import protocol as openai_protocol
from web.openai import responses_protocol
from web.pooling import protocol as pooling_protocol
from web.vllm import protocol as vllm_protocol

# The families whose bodies are declared (imported for that), and the order of docs/api.md.
FAMILIES = (openai_protocol, chat_protocol, responses_protocol, anthropic_protocol, pooling_protocol, vllm_protocol)
ORDER = ("completions", "chat/completions", "embeddings", "pooling", "classify", "score", "rerank",
         "chat/completions/batch", "tokenize", "detokenize", "load_lora_adapter", "unload_lora_adapter", "messages",
         "responses", "v2/embed")

MODELS: dict[str, type[BaseModel]] = {endpoint: declared()[endpoint][0] for endpoint in ORDER}
REFUSED: dict[str, dict[str, str]] = {endpoint: declared()[endpoint][1] for endpoint in ORDER}


def api_reference() -> str:
    """docs/api.md: per endpoint, the fields implemented and those refused, with reasons."""
    lines = ["# API fields", "",
             "Generated from `web/fields.py` (`python -m web.fields > docs/api.md`); a test keeps it current.",
             "Fields marked refused answer 400 naming the field when a request sets them; fields that",
             "neither OpenAI nor vLLM defines are refused too, unless the server runs with",
             "`--allow-unknown-fields`.", ""]
    for endpoint, model in MODELS.items():
        implemented = ", ".join(f"`{n}`" for n in model.model_fields)
        lines += [f"## `{path_of(endpoint)}`", "", "Implemented: " + implemented, ""]
        refused = REFUSED.get(endpoint, {})
        if refused:
            lines += ["| refused field | why |", "| --- | --- |"]
            lines += [f"| `{name}` | {why} |" for name, why in sorted(refused.items())]
            lines.append("")
    for name, refused in NESTED_REFUSED.items():
        if refused:
            lines += [f"In `{name}` (completions and chat): refused " +
                      ", ".join(f"`{field}` ({why})" for field, why in refused.items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(api_reference())
