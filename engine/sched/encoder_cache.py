"""The scheduler's view of the worker's encoder cache: which images' encoder outputs the worker
holds, who still needs them, and what to evict.

Entries are keyed by `mm_hash` and sized in embedding rows. A request that will read an image
takes a reference when the image's rows are first scheduled and drops it once its computed
tokens have passed the image (or it finishes); an entry nobody references is *freeable*: it
stays, to serve a later request with the same image, until space is needed, oldest freeable
first. Evicted hashes go to the worker in the next `SchedulerOutput` so both sides agree.
Plain Python: no torch, no event loop.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity = capacity_rows
        self.rows: dict[str, int] = {}  # cached entries -> their size
        self.refs: dict[str, set[str]] = {}  # entry -> requests that still read it
        self.freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, oldest first
        self.used = 0
        self._evicted: list[str] = []
        self.hits = 0  # references served from the cache (metrics)
        self.evictions = 0

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self.rows

    def can_allocate(self, rows: int, keep: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether `rows` fit now, counting what evicting the freeable entries would free (all but
        `keep`: entries the caller is about to read)."""
        free = self.capacity - self.used
        return rows <= free + sum(self.rows[h] for h in self.freeable if h not in keep)

    def reference(self, mm_hash: str, request_id: str) -> None:
        """`request_id` reads a cached entry (a hit keeps it from eviction)."""
        self.refs[mm_hash].add(request_id)
        self.freeable.pop(mm_hash, None)
        self.hits += 1

    def allocate(self, mm_hash: str, rows: int, request_id: str) -> None:
        """Reserve space for an entry the worker computes this step (evicting freeable ones, oldest
        first; `can_allocate` said there is room)."""
        while self.capacity - self.used < rows:
            victim, _ = self.freeable.popitem(last=False)
            self._evict(victim)
        self.rows[mm_hash] = rows
        self.refs[mm_hash] = {request_id}
        self.used += rows

    def release(self, mm_hash: str, request_id: str) -> None:
        """`request_id` no longer reads `mm_hash`; unreferenced, the entry becomes freeable."""
        readers = self.refs.get(mm_hash)
        if readers is None or request_id not in readers:
            return
        readers.discard(request_id)
        if not readers:
            self.freeable[mm_hash] = None

    def release_all(self, request_id: str, hashes: list[str]) -> None:
        for mm_hash in hashes:
            self.release(mm_hash, request_id)

    def _evict(self, mm_hash: str) -> None:
        self.used -= self.rows.pop(mm_hash)
        del self.refs[mm_hash]
        self._evicted.append(mm_hash)
        self.evictions += 1

    def take_evicted(self) -> list[str]:
        """Hashes evicted since the last call: the worker drops them too."""
        evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def usage(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0
