"""Benchmark models: made once in the user cache directory, then reused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.models.tiny import default_model_dir


def cached_model(model: str | None, name: str, make: Callable[[Path], object]) -> str:
    """`model` if given; else the cache's `name` directory, made with `make` the first time."""
    if model is not None:
        return model
    path = default_model_dir().parent / name
    if not (path / "model.safetensors").is_file():
        make(path)
    return str(path)
