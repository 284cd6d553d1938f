"""How a model's layers share the paged KV cache: KV cache groups (vLLM's hybrid KV cache manager).

A model whose layers all attend alike (all full, or all within one sliding window) has one group:
one block table per request, one cache tensor pair per layer. A model that mixes sliding and full
layers (Gemma 3, gpt-oss) would waste most of its cache that way: a sliding layer never reads a
block more than a window behind, yet a single block table keeps every block for every layer.

So the layers are split into groups of one kind (one window) and equal size `group_size`, each
with its own block table per request. The cache has `group_size` tensor pairs, and tensor pair j
is shared by the j-th layer of every group: a block id names one block in every tensor, and
whichever group's table holds the id owns that block in all of them. One pool of block ids then
serves every group, so the split between sliding and full blocks follows the load instead of
being fixed at start-up, and a sliding group's table releases the blocks behind its window.

Gemma 3 270M (15 sliding layers, 3 full): group size 3, five sliding groups and one full. A block
holds 3 layers' keys and values; a 4,096-token sequence with a 512-token window holds
256 (full) + 5 x 33 (sliding) = 421 blocks of 3 layers, where one table would hold 256 blocks of
18 layers: 0.27 of the memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """The KV cache groups of a model's layers (all of them, every pipeline stage's)."""

    group_windows: tuple[int | None, ...]  # each group's attention window (None: full attention)
    layer_group: tuple[int, ...]  # layer -> its group
    layer_slot: tuple[int, ...]  # layer -> its position in its group: the cache tensor pair it uses
    group_size: int

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Groups of at most `group_size` layers of one window, in layer order; `group_size` is the
        count of the rarest window, so the rarer kind wastes no cache (vLLM's rule). A kind whose
        count it does not divide leaves its last group short: that group's blocks are partly unused."""
        counts: dict[int | None, int] = {}
        for window in layer_windows:
            counts[window] = counts.get(window, 0) + 1
        size = min(counts.values(), default=1)
        group_windows: list[int | None] = []
        layer_group, layer_slot = [], []
        open_group: dict[int | None, tuple[int, int]] = {}  # window -> (its filling group, layers in it)
        for window in layer_windows:
            group, filled = open_group.get(window, (-1, size))
            if filled == size:
                group, filled = len(group_windows), 0
                group_windows.append(window)
            layer_group.append(group)
            layer_slot.append(filled)
            open_group[window] = (group, filled + 1)
        return cls(tuple(group_windows) or (None,), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def local_slots(self, layers: Sequence[int]) -> list[int]:
        """Each of `layers`' index into a rank's cache tensor pairs, which are the slots its layers
        use (under pipeline parallelism a stage holds some layers only), numbered in slot order."""
        used = sorted({self.layer_slot[i] for i in layers})
        return [used.index(self.layer_slot[i]) for i in layers]



def sequence_blocks(group_windows: Sequence[int | None], num_tokens: int, block_size: int, step_tokens: int) -> int:
    """Blocks one sequence of `num_tokens` holds at most: every block in a full group; in a sliding
    group its window and a step's tokens past it (released only after the step)."""
    def blocks(tokens: int) -> int:
        return -(-tokens // block_size) + (tokens < num_tokens)  # +1: a window straddles a boundary
    return sum(blocks(num_tokens if w is None else min(num_tokens, w + step_tokens)) for w in group_windows)
