"""Request and response ids: unique per process, cheap to make.

`uuid.uuid4()` reads the kernel's random source on every call, a syscall
that showed up in the server's profile at ~0.2 ms per request on this VM
(`trio-llm bench embed`). Ids only need to be unique, so one random prefix
per process and a counter do.
"""

from __future__ import annotations

import itertools
import uuid

_PREFIX = uuid.uuid4().hex[:16]
_COUNTER = itertools.count(1)


def random_id() -> str:
    """32 hex digits, unique within this process (and, by its random prefix, across processes)."""
    return f"{_PREFIX}{next(_COUNTER):016x}"
