"""The shared-storage layout: one safetensors file per encoder output, named by its `mm_hash`,
written under a temporary name and renamed, so a reader never sees half a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.errors import InvalidRequestError


def entry_path(root: str | Path, mm_hash: str) -> Path:
    if not mm_hash.isalnum():  # hashes are hex digests; anything else must not become a path
        raise InvalidRequestError(f"bad mm_hash {mm_hash!r}")
    return Path(root) / f"{mm_hash}.safetensors"


def save_rows(root: str | Path, mm_hash: str, rows: torch.Tensor) -> bool:
    """Store one image's encoder output (a no-op if the store has it); True if written. Blocking."""
    path = entry_path(root, mm_hash)
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{mm_hash}.", dir=path.parent)
    os.close(fd)
    try:
        save_file({"rows": rows.detach().to("cpu").contiguous()}, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return True


def load_rows(path: Path) -> torch.Tensor:
    """One stored encoder output, [rows, hidden]; `ValueError` if the file is damaged. Blocking."""
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"{path.name} is unreadable: {exc}") from None
    rows = tensors.get("rows")
    if rows is None or rows.dim() != 2:
        raise ValueError(f"{path.name} holds no [rows, hidden] tensor named 'rows'")
    return rows
