"""The paged KV cache's bookkeeping: fixed-size blocks, per-request block tables,
a free list with reference counts, and prefix caching by hashing full blocks.

Only ids live here; the tensors live in the worker. A block holds `block_size`
consecutive token positions of one sequence. A block whose tokens are all
computed gets a hash chained from its predecessor's, so two requests with the
same prefix share the same blocks. When a request finishes, its blocks return
to the free list but keep their hash: until the block is reused for something
else, a later request with the same prefix still hits it.

A request has one block table per KV cache group (engine/kv_groups.py): one for
most models, several for one that mixes sliding and full layers, all drawing on
one pool of ids. In a group with a sliding window (Mistral's every layer, Gemma 3's
and gpt-oss's sliding ones), a block none of a request's later tokens can attend
to is released while the request runs (vLLM's sliding-window manager): a long
sequence holds about a window's worth of blocks there. Its id stays in the table,
where attention masks it out, so the table keeps its shape and positions; another
request may reuse it. A prefix hit in such a group needs only the window's blocks
before the hit; the positions before it hold a placeholder id, masked the same way.
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
    group: int = 0  # the KV cache group whose prefix cache holds it (while it has a hash)


# A sliding group's table entry before the window of a prefix hit: never read unmasked, never
# written (new tokens go after the hit), never referenced or freed.
OUTSIDE_WINDOW = KVBlock(0)


@dataclass(frozen=True)
class CachedPrefix:
    """A request's first `num_blocks` blocks found in the prefix cache, in every group's table."""

    tables: tuple[list[KVBlock], ...]  # per group; a sliding group's starts with OUTSIDE_WINDOW entries
    num_blocks: int

    def block_ids(self, group: int = 0) -> list[int]:
        return [b.block_id for b in self.tables[group]]


class KVBlockManager:
    """Allocates KV blocks to requests. Plain Python; owned by the scheduler."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hasher: PrefixHasher | None = None, group_windows: Sequence[int | None] = (None,)) -> None:
        """`group_windows`: each KV cache group's attention window (None: full), one group by default."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher or PrefixHasher()
        self.num_collisions = 0  # hits whose tokens or parent differed: refused (counted for tests and logs)
        # The blocks made so far, in id order: a block is made when it is first taken. A GPU's cache
        # holds ~10^6 (675,363 beside the 0.5B shape on an H200), and making them all took ~1.5 s
        # of each start. Blocks never taken are free, and first in eviction order.
        self._blocks: list[KVBlock] = []
        # Free blocks once taken, in eviction order (front first). Cached blocks stay hashed while free.
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: list[dict[BlockHash, KVBlock]] = [{} for _ in self.group_windows]
        self._req_blocks: dict[str, list[list[KVBlock]]] = {}  # request id -> its table in each group
        self._released: dict[str, list[int]] = {}  # request id -> each table's leading entries released
        self._num_hashed_blocks: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self._blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live requests; blocks kept only by the prefix cache count as free."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._req_blocks.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in every group, as the worker takes them."""
        return tuple(self.block_ids(request_id, g) for g in range(self.num_groups))

    def blocks_held(self, request_id: str) -> int:
        """Blocks the request references now, over all its tables (released ones not counted)."""
        tables, released = self._req_blocks.get(request_id, []), self._released.get(request_id, [])
        return sum(len(table) - start for table, start in zip(tables, released, strict=True))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block of the group's table that the token after `num_computed` ones, and so
        every later one, still attends to: past num_computed - window (0 without a window)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

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

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest prefix of whole blocks every group holds: all of a full group's blocks, a
        sliding group's within the window before the prefix's end.

        At least one token is always left to compute, because the step that
        computes it produces the logits the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return CachedPrefix(tuple([] for _ in self.group_windows), 0)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = [self._hits(request, g, max_blocks) for g in range(self.num_groups)]
        n = min((len(_leading_hits(h)) for g, h in enumerate(hits) if self.group_windows[g] is None),
                default=max_blocks)
        while True:  # each sliding group may shorten it; a shorter prefix needs other blocks: again
            shortest = min(self._longest_windowed(g, hits[g], n) for g in range(self.num_groups))
            if shortest == n:
                break
            n = shortest
        tables = []
        for g, group_hits in enumerate(hits):
            start = self._first_needed(g, n * self.block_size)
            tables.append([OUTSIDE_WINDOW] * start + [b for b in group_hits[start:n] if b is not None])
        return CachedPrefix(tuple(tables), n)

    def _hits(self, request: Request, group: int, max_blocks: int) -> list[KVBlock | None]:
        """The group's cached block for each of the request's first blocks (None: a miss)."""
        cached = self._cached[group]
        hits: list[KVBlock | None] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = cached.get(block_hash)
            if block is not None and (block.parent_hash != self._parent_hash(request, i)
                                      or block.token_ids != self._block_tokens(request, i)):
                self.num_collisions += 1  # same hash, other content: never share it
                block = None
            if block is None and self.group_windows[group] is None:
                break  # a full group's hits end at its first miss
            hits.append(block)
        return hits

    def _longest_windowed(self, group: int, hits: list[KVBlock | None], limit: int) -> int:
        """The longest prefix up to `limit` blocks whose window the group holds whole."""
        if self.group_windows[group] is None:
            return limit
        n = min(limit, len(hits))
        while n and not all(b is not None for b in hits[self._first_needed(group, n * self.block_size):n]):
            n -= 1
        return n

    def _parent_hash(self, request: Request, index: int) -> BlockHash:
        return request.block_hashes[index - 1] if index else self.hasher.request_root(request.cache_key)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[index * self.block_size:(index + 1) * self.block_size])

    # ---- allocation ----------------------------------------------------------------------
    def room_for_all(self, requests: list[Request], num_new_tokens: int) -> bool:
        """Whether every one of `requests` (none with a cached prefix to take) can make room for
        `num_new_tokens` more tokens at once: `allocate_slots` then succeeds for each in turn. Blocks
        outside a window are released first, as `allocate_slots` releases them."""
        needed = sum(self._new_blocks(request, num_new_tokens) for request in requests)
        return needed * self.num_groups <= self.num_free_blocks

    def _new_blocks(self, request: Request, num_new_tokens: int, prefix: int = 0) -> int:
        """Blocks (per group) the request must add for `num_new_tokens` more tokens after its computed
        ones and a cached prefix of `prefix` blocks, once its blocks outside a window are released."""
        tables = self._req_blocks.get(request.request_id)
        if tables is not None:
            self._release_outside_window(request, tables)
        held = len(tables[0]) if tables else 0
        num_tokens = request.num_computed_tokens + prefix * self.block_size + num_new_tokens
        return max(self.blocks_needed(num_tokens) - held - prefix, 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing but releasing blocks outside a window, when there are not
        enough free blocks.
        """
        rid = request.request_id
        prefix = cached.num_blocks if cached else 0
        num_new_blocks = self._new_blocks(request, num_new_tokens, prefix)
        tables = self._req_blocks.get(rid)
        hits = [table[self._first_needed(g, prefix * self.block_size):] for g, table in enumerate(cached.tables)] \
            if cached else []
        revived = sum(1 for table in hits for b in table if b.ref_cnt == 0)  # free now, taken by this request
        if num_new_blocks * self.num_groups + revived > self.num_free_blocks:
            return False
        if tables is None:
            tables = self._req_blocks[rid] = [[] for _ in self.group_windows]
            self._released[rid] = [0] * self.num_groups
        for g, table in enumerate(tables):
            if cached:
                self._take_hits(hits[g])
                table.extend(cached.tables[g])
                self._released[rid][g] = len(cached.tables[g]) - len(hits[g])
            table.extend(self._take_free_block() for _ in range(num_new_blocks))
        if cached:
            self._num_hashed_blocks[rid] = prefix
        return True

    def _take_hits(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def _release_outside_window(self, request: Request, tables: list[list[KVBlock]]) -> None:
        """In each sliding group: release the leading blocks that the request's next token, and so
        every later one, no longer attends to."""
        released = self._released[request.request_id]
        for g, table in enumerate(tables):
            keep_from = min(self._first_needed(g, request.num_computed_tokens), len(table))
            for block in table[released[g]:keep_from]:
                self._unref(block)
            released[g] = max(released[g], keep_from)

    def _unref(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block.block_id] = block

    def _take_free_block(self) -> KVBlock:
        if len(self._blocks) < self.num_blocks:  # one never taken: it comes before every freed one
            block = KVBlock(len(self._blocks), ref_cnt=1)
            self._blocks.append(block)
            return block
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            cached = self._cached[block.group]
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        tables = self._req_blocks.get(rid)
        if not tables or not tables[0]:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_hashed_blocks.get(rid, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for g, table in enumerate(tables):
            # A released block may already hold another request's tokens: never hash it.
            for i in range(max(start, self._released[rid][g]), num_full):
                self._register(table[i], g, request, i)
        self._num_hashed_blocks[rid] = num_full

    def _register(self, block: KVBlock, group: int, request: Request, index: int) -> None:
        block_hash = request.block_hashes[index]
        if block.block_hash is None and block_hash not in self._cached[group]:
            block.block_hash = block_hash
            block.parent_hash = self._parent_hash(request, index)
            block.token_ids = self._block_tokens(request, index)
            block.group = group
            self._cached[group][block_hash] = block

    def free(self, request: Request) -> None:
        """Release the request's blocks. Last blocks first, so they are evicted first."""
        rid = request.request_id
        self._num_hashed_blocks.pop(rid, None)
        released = self._released.pop(rid, None)
        tables = self._req_blocks.pop(rid, None)
        if tables is None or released is None:
            return
        for table, start in zip(tables, released, strict=True):
            for block in reversed(table[start:]):
                self._unref(block)


def _leading_hits(hits: list[KVBlock | None]) -> list[KVBlock | None]:
    """The hits before the first miss."""
    for i, block in enumerate(hits):
        if block is None:
            return hits[:i]
    return hits
