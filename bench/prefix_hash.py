"""`trio-llm bench prefix-hash`: what hashing prefix-cache blocks costs against the prefill it saves.

Side by side in one run: each algorithm's time per 16-token block (hashing
the chained identities of a 512-token prompt, as the scheduler does once per
new request), and the model's own prefill step for that prompt (the real
worker, in this process). The cost must stay under 2% of the prefill step.
"""

from __future__ import annotations

import statistics
import time

from engine.api import EngineConfig, SamplingParams
from engine.config import HASH_ALGOS
from engine.sched.block_manager import KVBlockManager
from engine.sched.prefix_hash import PrefixHasher
from engine.sched.request import Request
from engine.worker.worker import Worker

PROMPT_TOKENS = 512
BLOCK_SIZE = 16


def hash_seconds_per_block(algo: str, repeats: int) -> float:
    """Median time per block to hash a fresh request's prompt, through the block manager."""
    kv = KVBlockManager(4, BLOCK_SIZE, hasher=PrefixHasher(algo, b"bench-model"))
    tokens = list(range(1000, 1000 + PROMPT_TOKENS))
    samples = []
    for i in range(repeats):
        request = Request(f"r{i}", tokens, SamplingParams(max_tokens=1), max_tokens=1)
        start = time.perf_counter()
        kv.update_block_hashes(request)
        samples.append((time.perf_counter() - start) / len(request.block_hashes))
    return statistics.median(samples)


def prefill_seconds(model_dir: str, repeats: int) -> float:
    """Median wall time of the worker's step that prefills one fresh 512-token prompt."""
    from dataclasses import replace

    from engine.core.open_core import build_scheduler
    config = EngineConfig(model=model_dir, enable_prefix_caching=False)
    worker = Worker(config)
    info = worker.load_model()
    worker.initialize_kv_cache(64)
    scheduler = build_scheduler(config, replace(info, num_kv_blocks=64, max_model_len=info.max_position_embeddings))
    samples = []
    for i in range(repeats + 2):
        scheduler.add_request(Request(f"p{i}", list(range(10, 10 + PROMPT_TOKENS)), SamplingParams(max_tokens=1),
                                      max_tokens=1))
        step = scheduler.schedule()
        start = time.perf_counter()
        result = worker.execute_model(step)
        samples.append(time.perf_counter() - start)
        scheduler.update_from_output(step, result)
        scheduler.schedule()  # frees the finished request's blocks for the next round
    return statistics.median(samples[2:])


def run(model_dir: str, repeats: int = 200) -> str:
    prefill = prefill_seconds(model_dir, max(5, repeats // 20))
    blocks = PROMPT_TOKENS // BLOCK_SIZE
    lines = [f"{PROMPT_TOKENS}-token prompt, {blocks} blocks of {BLOCK_SIZE}; prefill step (the model's forward) "
             f"{prefill * 1e3:.2f} ms",
             f"{'algorithm':<14} {'us/block':>9} {'per prompt (ms)':>16} {'of the prefill':>15}"]
    for algo in HASH_ALGOS:
        per_block = hash_seconds_per_block(algo, repeats)
        lines.append(f"{algo:<14} {per_block * 1e6:9.2f} {per_block * blocks * 1e3:16.3f} "
                     f"{per_block * blocks / prefill:14.3%}")
    lines.append("target: under 2% of the prefill step")
    return "\n".join(lines)
