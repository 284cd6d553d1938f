"""Data parallelism (`--data-parallel-size N`): N engine cores behind one `AsyncEngine`.

Each core is a whole engine: its own engine process, scheduler, KV cache and workers.
`DataParallelCores` is the `CoreHandle` the one `AsyncEngine` drives; it sends each
request to one live core:

- **by load**, as vLLM's DP coordinator scores engines: waiting requests weigh 4, running
  ones 1 (a core's waiting count includes requests sent and not yet applied, so a burst
  of submits between two steps spreads instead of piling on one core);
- **prefix-aware**: each core remembers the prompt prefixes (whole KV blocks, chained
  hashes) it was sent lately; a request whose prefix one core already holds goes there
  unless that core's load exceeds the least loaded one's by more than `AFFINITY_SLACK`.

A core that dies fails its own requests (its client does) and takes no more; the rest
serve on. `dead` only when every core is. Plain Python: `choose_core` and `PrefixMemory`
are tested without an event loop.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import fields, replace
from functools import partial

import anyio
import anyio.abc

from engine.concurrency.gather import gather_first_failure
from engine.config import EngineConfig
from engine.core.core_client import CoreClient
from engine.core.engine_core import AddRequest, CoreHandle
from engine.core.stats import EngineStats
from engine.cpu_binding import split_layout
from engine.errors import EngineDeadError

log = logging.getLogger("trio_llm.engine")

WAITING_WEIGHT = 4  # vLLM's DP coordinator: score = waiting * 4 + running
AFFINITY_SLACK = 8  # load units a core holding the prefix may exceed the least loaded one by
PREFIX_BLOCKS = 32  # prompt blocks hashed per request (the prefix that decides affinity)
REMEMBERED_PREFIXES = 65536  # per core, least recently sent dropped first


def load_score(stats: EngineStats) -> int:
    return stats.num_waiting * WAITING_WEIGHT + stats.num_running


def prefix_hashes(token_ids: Sequence[int], block_size: int, limit: int = PREFIX_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's whole blocks, first to last (at most `limit`): the i-th
    names the prefix of i + 1 blocks, as the prefix cache keys them."""
    hashes, previous = [], 0
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixMemory:
    """The prefixes one core was sent lately (an LRU of chained block hashes)."""

    def __init__(self, capacity: int = REMEMBERED_PREFIXES) -> None:
        self.capacity = capacity
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these `hashes` this core was sent."""
        matched = 0
        for h in hashes:
            if h not in self._seen:
                break
            matched += 1
        return matched

    def remember(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


def choose_core(scores: Sequence[int | None], matched: Sequence[int], slack: int = AFFINITY_SLACK) -> int:
    """The core for a request: `scores[i]` is core i's load (None: dead), `matched[i]` the prompt
    blocks it already holds. The longest match among cores within `slack` of the least load;
    else the least loaded (lowest index on ties). `EngineDeadError` when every core is dead."""
    live = [i for i, score in enumerate(scores) if score is not None]
    if not live:
        raise EngineDeadError("every data-parallel engine has stopped")
    least = min(live, key=lambda i: (scores[i], i))
    floor = scores[least]
    assert floor is not None
    near = [i for i in live if matched[i] and scores[i] <= floor + slack]  # type: ignore[operator]
    if near:
        return max(near, key=lambda i: (matched[i], -scores[i], -i))  # type: ignore[operator]
    return least


def sum_stats(per_engine: Sequence[EngineStats]) -> EngineStats:
    """One snapshot for N engines: counts summed, usage ratios averaged (the engines are the same
    size), every engine's workers listed, adapters merged."""
    first = per_engine[0]
    summed = {}
    for f in fields(EngineStats):
        values = [getattr(s, f.name) for s in per_engine]
        if f.name in ("kv_cache_usage", "encoder_cache_usage"):
            summed[f.name] = sum(values) / len(values)
        elif f.name in ("loop_lag", "loop_lag_max", "eplb", "max_lora"):
            summed[f.name] = values[0]  # one loop; the same config in every engine
        elif f.name == "workers_alive":
            summed[f.name] = tuple(alive for value in values for alive in value)
        elif f.name in ("running_lora_adapters", "waiting_lora_adapters"):
            summed[f.name] = tuple(sorted({name for value in values for name in value}))
        else:
            summed[f.name] = sum(values)
    return replace(first, **summed)


class DataParallelCores:
    """N cores as one `CoreHandle` (see the module docstring)."""

    def __init__(self, cores: Sequence[CoreHandle], block_size: int) -> None:
        self.cores = list(cores)
        self.block_size = block_size
        self.prefixes = [PrefixMemory() for _ in self.cores]
        self.sent = [0] * len(self.cores)  # requests sent to each core, since start

    @property
    def dead(self) -> bool:
        return all(core.dead for core in self.cores)

    def submit(self, message: AddRequest) -> None:
        """Send the request to the core `choose_core` picks; `EngineDeadError` when none is live."""
        request = message.request
        # Prompts of embeddings, or of images and salts, share KV blocks only within their own
        # cache namespace: no affinity for them.
        plain = request.prompt_embeds is None and request.cache_key is None
        hashes = prefix_hashes(request.prompt_token_ids, self.block_size) if plain else []
        scores = [None if core.dead else load_score(core.stats()) for core in self.cores]
        index = choose_core(scores, [memory.matched_blocks(hashes) for memory in self.prefixes])
        self.prefixes[index].remember(hashes)
        self.sent[index] += 1
        self.cores[index].submit(message)

    def abort(self, request_id: str) -> None:
        """Every core is told; only the one holding the request has anything to abort."""
        for core in self.cores:
            core.abort(request_id)

    def stats(self) -> EngineStats:
        return sum_stats(self.engine_stats())

    def engine_stats(self) -> list[EngineStats]:
        """Each engine's snapshot, in data-parallel rank order."""
        return [core.stats() for core in self.cores]

    @property
    def pids(self) -> tuple[int, ...]:
        """Every engine process's pid, in data-parallel rank order."""
        return tuple(pid for core in self.cores for pid in core.pids)

    async def add_lora(self, name: str, path: str) -> None:
        """On every live engine at once; the first error is raised. Cancellation stops the wait."""
        await self._on_every_live_core("add_lora", name, path)

    async def remove_lora(self, name: str) -> None:
        """On every live engine at once. Cancellation stops the wait."""
        await self._on_every_live_core("remove_lora", name)

    async def _on_every_live_core(self, method: str, *args: str) -> None:
        live = [core for core in self.cores if not core.dead]
        if not live:
            raise EngineDeadError("every data-parallel engine has stopped")

        await gather_first_failure([partial(getattr(core, method), *args) for core in live])


def shared_cpus_warning(config: EngineConfig) -> str | None:
    """What to tell a user whose data-parallel engines must share compute CPUs (fewer CPUs than
    engines): they take turns, so the engines serve no faster than one would. None otherwise."""
    layout, size = config.cpu_layout, config.data_parallel_size
    if size == 1 or layout is None or len(layout.compute) >= size:
        return None
    cpus = ", ".join(map(str, layout.compute))
    return (f"{size} data-parallel engines share {len(layout.compute)} compute CPU(s) (CPU {cpus}): they "
            f"take turns on them, so -dp {size} serves no faster than one engine here; each engine needs CPUs of "
            "its own (--cpu-threads-bind)")


def data_parallel_configs(config: EngineConfig) -> list[EngineConfig]:
    """One engine's config per data-parallel rank: the compute CPUs split between them (each
    engine a share; they share CPUs only when there are fewer than engines)."""
    size = config.data_parallel_size
    if size == 1:
        return [config]
    layouts = split_layout(config.cpu_layout, size)
    return [replace(config, data_parallel_size=1, cpu_layout=layout) for layout in layouts]


async def run_data_parallel_rank(client: CoreClient, rank: int, clients: Sequence[CoreClient], *,
                                 task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run one data-parallel engine's client. Its failure fails its own requests (the client
    does) and is logged; it is raised only once every engine has failed, which stops the rest.
    Cancellation (the owner's shutdown) stops it."""
    try:
        await client.run(task_status=task_status)
    except Exception as exc:
        if client.closing:
            return  # the owner is stopping the engines
        if all(other.dead for other in clients):
            raise
        log.error("data-parallel engine %d stopped (%s); the other engines serve on", rank, exc)
