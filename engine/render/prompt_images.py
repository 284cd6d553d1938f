"""Images of a prompt: loaded (data URLs, allowed http(s) hosts, PIL images, arrays), checked
against the limits, preprocessed and hashed, and their placeholders expanded.

All blocking work for one prompt's images runs in one worker-thread call under the renderer's
limiter (per request, never per token). Each `<image>` placeholder token in the prompt expands
to the image's rows, so the prompt's length (and `usage.prompt_tokens`) counts them, as vLLM's
and transformers' processors do.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from engine.errors import InvalidRequestError
from engine.mm_features import ImageFeature
from engine.render.image import ImageProcessorConfig, decode_image, mm_hash, preprocess


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 999  # per prompt: vLLM's --limit-mm-per-prompt default
    max_image_bytes: int = 20 << 20  # an encoded image (a data URL's payload, a download)
    max_image_pixels: int = 4096 * 4096
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name; none by default
    fetch_timeout: float = 10.0


@dataclass(frozen=True)
class ImageSpec:
    """What the renderer needs to know of a vision-language model."""

    processor: ImageProcessorConfig
    image_token_id: int
    image_token: str
    rows_per_image: int


def load_image(source: Any, limits: ImageLimits) -> Image.Image:
    """An image from an `image_url` (a `data:` URL, or http(s) on an allowed host), a PIL image or
    an array; `InvalidRequestError` for anything else or beyond the limits. Blocking."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        try:
            image = Image.fromarray(source)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the image array cannot be read: {exc}", param="image") from None
    elif isinstance(source, str):
        return decode_image(_url_bytes(source, limits), limits.max_image_pixels)
    else:
        raise InvalidRequestError(f"unsupported image type {type(source).__name__}", param="image")
    if image.width * image.height > limits.max_image_pixels:
        raise InvalidRequestError(f"the image has {image.width}x{image.height} pixels, more than the limit of "
                                  f"{limits.max_image_pixels}", param="image")
    return image


def _url_bytes(url: str, limits: ImageLimits) -> bytes:
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise InvalidRequestError("an image data URL must be base64 (data:image/png;base64,...)", param="image_url")
        if len(payload) * 3 // 4 > limits.max_image_bytes:
            raise InvalidRequestError(f"the image is larger than the limit of {limits.max_image_bytes} bytes",
                                      param="image_url")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the image data URL is not valid base64", param="image_url") from None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise InvalidRequestError(f"image URLs must be data: or http(s) URLs, not {parsed.scheme or 'a path'}:",
                                  param="image_url")
    if parsed.hostname not in limits.allowed_media_domains:
        raise InvalidRequestError(f"image URL host {parsed.hostname!r} is not in --allowed-media-domains",
                                  param="image_url")
    return _fetch(url, limits)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead to a host the allow-list does not name: refuse it."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise InvalidRequestError(f"the image URL redirects (to {newurl}); give the final URL", param="image_url")


_OPENER = urllib.request.build_opener(_NoRedirects)


def _fetch(url: str, limits: ImageLimits) -> bytes:
    try:
        with _OPENER.open(url, timeout=limits.fetch_timeout) as response:
            data: bytes = response.read(limits.max_image_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"the image URL could not be fetched: {exc}", param="image_url") from None
    if len(data) > limits.max_image_bytes:
        raise InvalidRequestError(f"the image is larger than the limit of {limits.max_image_bytes} bytes",
                                  param="image_url")
    return data


def process_images(sources: list[Any], spec: ImageSpec, limits: ImageLimits) -> list[tuple[str, Any]]:
    """(mm_hash, pixel values) per image, in order. Blocking: one worker-thread call per prompt."""
    if len(sources) > limits.max_images:
        raise InvalidRequestError(f"{len(sources)} images in one prompt; the limit is {limits.max_images} "
                                  "(--limit-mm-per-prompt)", param="messages")
    processed = []
    for source in sources:
        image = load_image(source, limits)
        processed.append((mm_hash(image, spec.processor), preprocess(image, spec.processor)))
    return processed


def expand_placeholders(token_ids: list[int], images: list[tuple[str, Any]],
                        spec: ImageSpec) -> tuple[list[int], list[ImageFeature]]:
    """Each image placeholder token becomes `rows_per_image` of them; one placeholder per image."""
    found = token_ids.count(spec.image_token_id)
    if found != len(images):
        raise InvalidRequestError(f"the prompt has {found} {spec.image_token} placeholders for {len(images)} "
                                  "images", param="messages")
    expanded: list[int] = []
    features = []
    images_left = iter(images)
    for token in token_ids:
        if token != spec.image_token_id:
            expanded.append(token)
            continue
        digest, pixels = next(images_left)
        features.append(ImageFeature(digest, len(expanded), spec.rows_per_image, pixels))
        expanded.extend([spec.image_token_id] * spec.rows_per_image)
    return expanded, features
