"""Multimodal inputs as the engine carries them: plain data, shared by the renderer, the
scheduler and the worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageFeature:
    """One image of a prompt: the run of placeholder positions its encoder rows replace.

    `mm_hash` names the image by content (and processor settings): equal images share encoder
    outputs, in the encoder cache and through an EC connector."""

    mm_hash: str
    offset: int  # prompt position of the first placeholder row
    length: int  # placeholder rows (the encoder's output rows for one image)
    pixel_values: Any = None  # [3, H, W] float32 tensor: what the encoder reads

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) include any of this image's rows."""
        return self.offset < end and start < self.end
