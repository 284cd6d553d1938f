"""Prompt embeddings: decode a base64 `torch.save` payload and validate it for the model.

Runs in a worker thread (the renderer offloads it); every step here either
releases the GIL (base64 decoding, a cast) or holds it for microseconds
(see `tensor_loader`). The base64 decoder writes a `bytearray` that the
returned tensor views when no cast is needed: one copy of the data, not three. Every failure is an `InvalidRequestError`
naming the reason, except running out of memory, which is re-raised as is.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass

import pybase64
import torch

from engine.errors import InvalidRequestError
from engine.render.tensor_loader import TensorPayloadError, load_tensor

PARAM = "prompt_embeds"
ARCHIVE_OVERHEAD_BYTES = 64 << 10  # zip headers and the pickle around the tensor data


@dataclass(frozen=True)
class EmbedsLimits:
    """What a prompt-embeddings tensor must satisfy for this model."""

    hidden_size: int
    max_rows: int  # the context length: at least one position must be left to generate
    dtype: torch.dtype  # floating payloads are cast to this
    max_payload_bytes: int  # decoded bytes

    @classmethod
    def for_model(cls, hidden_size: int, max_model_len: int, dtype: torch.dtype,
                  max_payload_bytes: int | None = None) -> EmbedsLimits:
        """By default a payload may be as large as a float32 tensor filling the whole context."""
        default = max_model_len * hidden_size * 4 + ARCHIVE_OVERHEAD_BYTES
        return cls(hidden_size, max_model_len - 1, dtype, max_payload_bytes or default)


def decode_prompt_embeds(payload: str | bytes | bytearray | memoryview, limits: EmbedsLimits) -> torch.Tensor:
    """The 2-D `(rows, hidden_size)` tensor in `payload` (base64 of a `torch.save` file), in the model dtype."""
    # A str goes to pybase64 as is: `str.encode` would copy it with the GIL held (~2.5 ms for 22 MB).
    if len(payload) // 4 * 3 > limits.max_payload_bytes:
        raise InvalidRequestError(f"prompt_embeds payload is larger than the limit of {limits.max_payload_bytes} "
                                  "bytes", param=PARAM)
    try:
        raw = pybase64.b64decode_as_bytearray(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"prompt_embeds is not valid base64: {exc}", param=PARAM) from None
    try:
        tensor = load_tensor(raw)
    except TensorPayloadError as exc:
        raise InvalidRequestError(f"prompt_embeds could not be loaded: {exc}", param=PARAM) from None
    return check_prompt_embeds(tensor, limits)


def check_prompt_embeds(tensor: torch.Tensor, limits: EmbedsLimits) -> torch.Tensor:
    """Validate a tensor given as prompt embeddings; return it dense, 2-D and in the model dtype.

    Shape and dtype are checked before a sparse tensor is densified, so a
    small sparse payload cannot ask for a huge dense allocation.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"prompt_embeds must be a tensor, got {type(tensor).__name__}", param=PARAM)
    shape = tuple(tensor.shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]  # a leading batch dimension of 1 is dropped
    if len(shape) != 2:
        raise InvalidRequestError(f"prompt_embeds must have 2 dimensions (rows, hidden size), got shape "
                                  f"{tuple(tensor.shape)}", param=PARAM)
    rows, hidden = shape
    if hidden != limits.hidden_size:
        raise InvalidRequestError(f"prompt_embeds hidden size is {hidden}, the model's is {limits.hidden_size}",
                                  param=PARAM)
    if rows == 0:
        raise InvalidRequestError("prompt_embeds has no rows", param=PARAM)
    if rows > limits.max_rows:
        raise InvalidRequestError(f"prompt_embeds has {rows} rows; the context allows at most {limits.max_rows} "
                                  "with room to generate", param=PARAM)
    if not tensor.dtype.is_floating_point:
        raise InvalidRequestError(f"prompt_embeds must be a floating-point tensor, got {tensor.dtype}", param=PARAM)
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.reshape(rows, hidden)
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidRequestError("prompt_embeds contains NaN or infinite values", param=PARAM)
    if tensor.dtype != limits.dtype:
        tensor = tensor.to(limits.dtype)
        if not bool(torch.isfinite(tensor).all()):  # finite in its own dtype, out of range in the model's
            raise InvalidRequestError(f"prompt_embeds has values out of the range of {limits.dtype}", param=PARAM)
        return tensor
    return tensor.contiguous()
