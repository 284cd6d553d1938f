"""The bodies of vLLM's own endpoints: /tokenize, /detokenize and the LoRA adapters'."""

from __future__ import annotations

from typing import Any

from web.chat.protocol import _ChatTemplating
from web.http.bodies import Body
from web.http.fields import declare_fields


class TokenizeRequest(_ChatTemplating):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # the tokens' strings beside their ids


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(Body):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # replace an adapter of this name (its requests read the new weights)


class UnloadLoRAAdapterRequest(Body):
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's; the name decides


declare_fields(TokenizeRequest, "tokenize",
               {"mm_processor_kwargs": "the image processor's settings come from the model"})
declare_fields(DetokenizeRequest, "detokenize")
declare_fields(LoadLoRAAdapterRequest, "load_lora_adapter")
declare_fields(UnloadLoRAAdapterRequest, "unload_lora_adapter")
