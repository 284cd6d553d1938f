"""Rendering chat messages with the model's Jinja chat template, the way transformers does."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError, ModelLoadError


class TemplateError(InvalidRequestError):
    pass


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


IMAGE_PART_TYPES = ("image_url", "image", "image_pil")
# Where a `prompt_embeds` content part sits in the rendered template: the text around it is
# tokenized, the part's rows take its place (no token of any vocabulary spells this).
EMBEDS_SENTINEL = "\x00trio-llm:prompt_embeds\x00"


@dataclass
class ChatMedia:
    """What a conversation's content parts carry besides text, in prompt order."""

    images: list[Any] = field(default_factory=list)
    embeds: list[Any] = field(default_factory=list)  # prompt_embeds payloads (vLLM's `data`)


def extract_media(messages: list[dict[str, Any]], template: str | None,
                  image_token: str) -> tuple[list[dict[str, Any]], ChatMedia]:
    """Messages ready for the chat template, and the images and prompt embeddings their content
    parts carry, in order.

    Content given as a list of parts (OpenAI's form) is kept as parts (`{"type": "image"}` for an
    image) when the template handles them (it names the "image" type), and flattened to text
    otherwise, with one `image_token` line per image before the message's text (vLLM's "string"
    content format). A `prompt_embeds` part (vLLM's: `{"type": "prompt_embeds", "data": base64}`)
    becomes `EMBEDS_SENTINEL` in the text, where it stood."""
    parts_aware = template is not None and ("'image'" in template or '"image"' in template)
    out: list[dict[str, Any]] = []
    media = ChatMedia()
    for i, message in enumerate(validate_messages(messages)):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        texts: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "prompt_embeds"):
                texts.append(str(part.get("text", "")) if kind == "text" else _embeds_part(part, i, media))
                parts.append({"type": "text", "text": texts[-1]})
            elif kind in IMAGE_PART_TYPES:
                media.images.append(_image_source(part, kind, i))
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(f"messages[{i}]: unsupported content part type {kind!r}; supported: "
                                          f"text, prompt_embeds, {', '.join(IMAGE_PART_TYPES)}", param="messages")
        num_images = len(parts) - len(texts)
        flat = f"{image_token}\n" * num_images + "".join(texts)
        out.append({**message, "content": parts if parts_aware else flat})
    return out, media


def _embeds_part(part: dict[str, Any], index: int, media: ChatMedia) -> str:
    data = part.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidRequestError(f"messages[{index}]: a prompt_embeds part needs its data (base64 of a "
                                  "torch.save tensor)", param="messages")
    media.embeds.append(data)
    return EMBEDS_SENTINEL


def _image_source(part: dict[str, Any], kind: str, index: int) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"messages[{index}]: an {kind} part needs its {kind}", param="messages")
    return value


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
    return messages


def render_chat(template: str | None, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None, **extra: Any) -> str:
    """Blocking (template rendering): offload for large conversations."""
    if not template:
        raise InvalidRequestError("this model has no chat_template in tokenizer_config.json; "
                                  "use the completions API instead", param="messages")
    validate_messages(messages)
    try:
        compiled = _compile(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "", **extra)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template failed to render: {exc}", param="messages") from exc


def resolve_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM reads it)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template long or odd enough not to be a path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ModelLoadError(f"--chat-template {value!r} is neither a file nor a Jinja template")
