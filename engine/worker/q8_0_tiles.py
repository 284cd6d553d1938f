"""Which q8_0 layers get tiles (`Linear.pack_q8_0_tiles`: the weight laid out once for auto's two
int8 levels, a second copy of it): every layer of at most 512 features, wider ones while all the
tiles stay within a budget, a quarter of the machine's memory (docs/decisions.md, "Tiles at every
width"). Plain functions: the worker calls `lay_out_q8_0_tiles` once the weights are final."""

from __future__ import annotations

import os
from pathlib import Path

from engine.kernels import q8_0_rows
from engine.models.layers import Linear


def tile_budget_bytes() -> int:
    """What q8_0 tiles of layers wider than 512 features may take together: a quarter of this
    machine's memory (they are a second copy of those weights)."""
    return memory_bytes() // 4


def memory_bytes() -> int:
    """This machine's memory, or the container's where a cgroup (v2) limits it to less."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def lay_out_q8_0_tiles(layers: list[Linear], budget: int) -> tuple[int, int, int]:
    """Tiles for `layers` (q8_0 under auto): every one of at most 512 features, wider ones while
    all the tiles together stay within `budget` bytes. (layers tiled, their tiles' bytes, wider
    layers left out for the budget)."""
    held = tiled = left_out = 0
    for layer in sorted(layers, key=is_wide):  # short ones first
        if is_wide(layer) and held + q8_0_tile_bytes(layer) > budget:
            left_out += 1
        elif layer.pack_q8_0_tiles():
            tiled += 1
            held += q8_0_tile_bytes(layer)
    return tiled, held, left_out


def is_wide(layer: Linear) -> bool:
    """A q8_0 layer wider than auto's two levels take without tiles (512 features)."""
    return layer.weight.shape[1] > q8_0_rows.TWO_LEVELS_UP_TO_K


def q8_0_tile_bytes(layer: Linear) -> int:
    """The bytes of a q8_0 layer's tiles (`q8_0_rows.pack_tiles`): its whole tiles of 16 rows, each
    block's 32 bytes and scale."""
    out_features, in_features = layer.weight.shape
    return out_features // 16 * 16 * (in_features // 32) * (32 + 4)
