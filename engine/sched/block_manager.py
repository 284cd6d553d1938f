"""The paged KV cache's bookkeeping: fixed-size blocks, per-request block tables,
a free list with reference counts, and prefix caching by hashing full blocks.

Only ids live here; the tensors live in the worker. A block holds `block_size`
consecutive token positions of one sequence. A block whose tokens are all
computed gets a hash chained from its predecessor's, so two requests with the
same prefix share the same blocks. When a request finishes, its blocks return
to the free list but keep their hash: until the block is reused for something
else, a later request with the same prefix still hits it.

With a sliding window on every layer (Mistral; `sliding_window`), a block none
of a request's later tokens can attend to is released while the request runs
(vLLM's sliding-window manager): a long sequence holds about a window's worth of
blocks. Its id stays in the request's block table, where attention masks it
out, so the table keeps its shape and positions; another request may reuse it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.sched.prefix_hash import BlockHash, PrefixHasher
from engine.sched.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # What the hash stands for, checked on every hit: a hash collision must never share KV.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class KVBlockManager:
    """Allocates KV blocks to requests. Plain Python; owned by the scheduler."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hasher: PrefixHasher | None = None, sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._released: dict[str, int] = {}  # request id -> its leading blocks released (outside the window)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher or PrefixHasher()
        self.num_collisions = 0  # hits whose tokens or parent differed: refused (counted for tests and logs)
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front first). Cached blocks stay hashed while free.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self._blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live requests; blocks kept only by the prefix cache count as free."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching ------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        size = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else self.hasher.request_root(request.cache_key)
            hashes.append(self.hasher.block(parent, tokens[start:start + size]))

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Blocks already holding a prefix of the request's tokens.

        At least one token is always left to compute, because the step that
        computes it produces the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self._cached.get(block_hash)
            if block is None:
                break
            if block.parent_hash != self._parent_hash(request, i) or block.token_ids != self._block_tokens(request, i):
                self.num_collisions += 1  # same hash, other content: never share it
                break
            hits.append(block)
        return hits

    def _parent_hash(self, request: Request, index: int) -> BlockHash:
        return request.block_hashes[index - 1] if index else self.hasher.request_root(request.cache_key)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[index * self.block_size:(index + 1) * self.block_size])

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_prefix: Sequence[KVBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        held = self._req_blocks.setdefault(request.request_id, [])
        self._release_outside_window(request, held)
        num_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(held) - len(cached_prefix)
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)  # free now, taken by this request
        if num_new_blocks + revived > len(self._free):
            if not held:
                del self._req_blocks[request.request_id]
            return False
        for block in cached_prefix:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        held.extend(cached_prefix)
        held.extend(self._take_free_block() for _ in range(max(num_new_blocks, 0)))
        if cached_prefix:
            self._num_hashed_blocks[request.request_id] = len(held) - max(num_new_blocks, 0)
        return True

    def _release_outside_window(self, request: Request, held: list[KVBlock]) -> None:
        """With a sliding window: release the leading blocks that the request's next token, and so
        every later one, no longer attends to (it sees positions past num_computed - window)."""
        if self.sliding_window is None or not held:
            return
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1)
        keep_from = min(first_needed // self.block_size, len(held))
        start = self._released.get(request.request_id, 0)
        for block in held[start:keep_from]:
            self._unref(block)
        if keep_from > start:
            self._released[request.request_id] = keep_from

    def _unref(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block.block_id] = block

    def _take_free_block(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_hashed_blocks.get(rid, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            block = blocks[i]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.parent_hash = self._parent_hash(request, i)
                block.token_ids = self._block_tokens(request, i)
                self._cached[block_hash] = block
        self._num_hashed_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Last blocks first, so they are evicted first."""
        rid = request.request_id
        self._num_hashed_blocks.pop(rid, None)
        released = self._released.pop(rid, 0)
        for block in reversed(self._req_blocks.pop(rid, [])[released:]):
            self._unref(block)
