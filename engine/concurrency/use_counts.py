"""`UseCounts`: how many users each name has, and a wait until one has none left."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import anyio


class UseCounts:
    """Counts of users by name (a LoRA adapter's open requests), for one event loop's tasks."""

    def __init__(self) -> None:
        self._counts: Counter[Hashable] = Counter()
        self._released = anyio.Event()

    def __getitem__(self, name: Hashable) -> int:
        return self._counts[name]

    def acquire(self, name: Hashable) -> None:
        self._counts[name] += 1

    def release(self, name: Hashable) -> None:
        self._counts[name] -= 1
        if self._counts[name] <= 0:
            del self._counts[name]
        self._released.set()
        self._released = anyio.Event()

    @contextmanager
    def using(self, name: Hashable) -> Iterator[None]:
        """One user of `name` while the block runs."""
        self.acquire(name)
        try:
            yield
        finally:
            self.release(name)

    async def wait_unused(self, name: Hashable) -> None:
        """Return once `name` has no user. Cancellation just stops the wait."""
        while self._counts[name] > 0:
            await self._released.wait()
