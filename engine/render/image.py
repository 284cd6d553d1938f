"""Images in: decode (Pillow, with limits), preprocess as transformers' `CLIPImageProcessor`
does, and hash.

`decode_image` refuses what is not a PNG, JPEG or WebP, what declares more pixels than
allowed (checked from the header, before any pixel is decoded: no decompression bombs), and
what is truncated or corrupt. `preprocess` reproduces the PIL backend of transformers' CLIP
processor exactly: convert to RGB, resize (shortest edge, aspect kept, the configured PIL
resampling), center crop, rescale, normalise, channels first. `mm_hash` names an image by
its decoded pixels and the processor settings, so the same picture sent twice (in any
encoding) is one cache entry.

Blocking CPU work: the renderer runs it in worker threads under its limiter.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from engine.errors import InvalidRequestError
from engine.models.hf_config import read_json_file

FORMATS = ("PNG", "JPEG", "WEBP")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    shortest_edge: int | None = 224
    height: int | None = None  # a fixed (height, width) resize instead of shortest_edge
    width: int | None = None
    crop_height: int = 224
    crop_width: int = 224
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = 3  # PIL's BICUBIC
    do_convert_rgb: bool = True

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        """From `preprocessor_config.json`, or the `image_processor` of `processor_config.json`."""
        directory = Path(model_dir)
        raw = read_json_file(directory / "preprocessor_config.json")
        if not raw:
            raw = read_json_file(directory / "processor_config.json").get("image_processor", {})
        return cls.from_hf(raw)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        size = raw.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        plain = {f.name for f in fields(cls)} - {"shortest_edge", "height", "width", "crop_height", "crop_width"}
        values = {k: raw[k] for k in plain if k in raw}
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(float(v) for v in values[key])
        return cls(shortest_edge=size.get("shortest_edge"), height=size.get("height"), width=size.get("width"),
                   crop_height=int(crop["height"]), crop_width=int(crop["width"]), **values)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """A PNG, JPEG or WebP image from its bytes; `InvalidRequestError` for anything else, for more
    than `max_pixels` pixels (read from the header before decoding), or for a damaged file."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequestError("the image is not a PNG, JPEG or WebP image", param="image_url") from None
    except Image.DecompressionBombError:  # Pillow's own cap (about 179 M pixels) was hit first
        raise InvalidRequestError(f"the image has more pixels than allowed: more than the limit of {max_pixels}",
                                  param="image_url") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidRequestError(f"the image has {width}x{height} pixels, more than the limit of {max_pixels}",
                                  param="image_url")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequestError(f"the image could not be decoded: {exc}", param="image_url") from None
    return image


def _resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    if cfg.shortest_edge:
        short, long = sorted((height, width))
        new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)
    assert cfg.height and cfg.width, "a size needs shortest_edge or height and width"
    return cfg.height, cfg.width


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> [height, width, C], padding with zeros where the image is smaller."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers and vLLM do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> torch.Tensor:
    """The pixel values transformers' CLIP image processor (PIL backend) gives: [3, H, W] float32."""
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    if cfg.do_resize:
        height, width = _resized_size(image.height, image.width, cfg)
        image = image.resize((width, height), resample=Image.Resampling(cfg.resample), reducing_gap=None)
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if cfg.do_center_crop:
        pixels = _center_crop(pixels, cfg.crop_height, cfg.crop_width)
    values = pixels.astype(np.float64) * cfg.rescale_factor if cfg.do_rescale else pixels.astype(np.float64)
    values = values.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)
        std = np.array(cfg.image_std, dtype=np.float32)
        values = (values - mean) / std
    return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))


def mm_hash(image: Image.Image, cfg: ImageProcessorConfig) -> str:
    """sha256 of the decoded pixels (mode, size, bytes) and the processor settings."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size}:{cfg!r}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
