"""`trio-llm bench loop-lag`: how late the event loop wakes while prompt-embeddings payloads decode.

N requests, each carrying one `rows x hidden` bfloat16 payload (base64 of a
`torch.save` file), are rendered concurrently by the real `Renderer` while
the loop-lag probe sleeps 1 ms at a time and records how late it wakes.
Side by side, in one run, rounds interleaved:

- `inline torch.load`: the old behaviour (vLLM's): base64 and
  `torch.load(weights_only=True)` on the event loop. The baseline.
- `thread torch.load`: the same decoder in worker threads; `torch.load`
  holds the GIL while it copies storages, so the loop still stalls.
- `inline ours`: our decoder on the loop, to show what it costs by itself.
- `thread ours`: what the renderer does: our decoder in worker threads.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field

import anyio
import pybase64
import torch

from engine.concurrency.loop_lag import run_loop_lag_probe
from engine.render.prompt_embeds import EmbedsLimits, check_prompt_embeds, decode_prompt_embeds
from engine.render.renderer import PayloadDecoder, Renderer
from engine.worker.cpu_allocator import keep_freed_memory_in_heap

PROBE_INTERVAL = 0.001


def torch_load_decode(payload: str | bytes | bytearray | memoryview, limits: EmbedsLimits) -> torch.Tensor:
    """The decoder the renderer replaced: `torch.load` with the process-wide sparse check."""
    raw = pybase64.b64decode(payload, validate=True)
    with torch.sparse.check_sparse_tensor_invariants():  # type: ignore[no-untyped-call]  # torch leaves it bare
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    return check_prompt_embeds(tensor, limits)


MODES: dict[str, tuple[PayloadDecoder, bool]] = {  # name -> (decoder, offloaded)
    "inline torch.load": (torch_load_decode, False),
    "thread torch.load": (torch_load_decode, True),
    "inline ours": (decode_prompt_embeds, False),
    "thread ours": (decode_prompt_embeds, True),
}


@dataclass
class LagResult:
    mode: str
    lags: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def line(self) -> str:
        return (f"{self.mode:<20} {self.percentile(0.5) * 1e3:8.2f} {self.percentile(0.99) * 1e3:8.2f} "
                f"{max(self.lags) * 1e3:8.2f} {min(self.seconds) * 1e3:9.1f} {len(self.lags):8d}")


def make_payloads(count: int, rows: int, hidden: int) -> list[str]:
    payloads = []
    for i in range(count):
        buffer = io.BytesIO()
        torch.save(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16), buffer)
        payloads.append(base64.b64encode(buffer.getvalue()).decode())
    return payloads


class _Probe:
    """Collects the probe's lag samples and lets a task wait for the next one."""

    def __init__(self, lags: list[float]) -> None:
        self.lags = lags
        self._next = anyio.Event()

    def observe(self, lag: float) -> None:
        self.lags.append(lag)
        self._next.set()
        self._next = anyio.Event()

    async def next_sample(self) -> None:
        await self._next.wait()


async def measure(renderer: Renderer, offloaded: bool, payloads: list[str], result: LagResult) -> None:
    """Decode every payload while the probe records lag.

    Offloaded, all requests are in flight at once (the most contention for
    the CPUs). Inline, each decode stalls the loop, and the probe records that
    stall before the next decode starts: one stall per request, the smallest
    baseline the inline design can show (requests arriving together would
    stack their stalls).
    """
    probe = _Probe(result.lags)
    async with anyio.create_task_group() as probe_group:
        await probe_group.start(run_loop_lag_probe, probe.observe, PROBE_INTERVAL)
        start = anyio.current_time()
        if offloaded:
            async with anyio.create_task_group() as requests:
                for payload in payloads:
                    requests.start_soon(renderer.render_one, {"prompt_embeds": payload})
        else:
            decode, limits = renderer.decode_payload, renderer.embeds_limits
            assert limits is not None
            for payload in payloads:
                decode(payload, limits)  # on the loop, as vLLM's renderer did
                await probe.next_sample()
        result.seconds.append(anyio.current_time() - start)
        await probe.next_sample()  # the last stall, if any, is recorded when the probe wakes
        probe_group.cancel_scope.cancel()


async def run(requests: int = 16, rows: int = 2048, hidden: int = 4096, rounds: int = 3,
              workers: int = 4) -> list[LagResult]:
    keep_freed_memory_in_heap()  # as in a serving process: its worker sets this when it loads the model
    payloads = await anyio.to_thread.run_sync(make_payloads, requests, rows, hidden)
    limits = EmbedsLimits.for_model(hidden, rows + 1, torch.bfloat16)
    limiter = anyio.CapacityLimiter(workers)
    results = {mode: LagResult(mode) for mode in MODES}
    for _ in range(rounds):
        for mode, (decoder, offloaded) in MODES.items():
            # The renderer has no tokenizer here: only prompt-embeddings payloads are rendered.
            renderer = Renderer(None, 0, limiter, limits, decode_payload=decoder)  # type: ignore[arg-type]
            await measure(renderer, offloaded, payloads, results[mode])
    return list(results.values())


def report(results: list[LagResult], requests: int, rows: int, hidden: int, rounds: int, workers: int) -> str:
    lines = [f"{requests} requests x {rows}x{hidden} bfloat16 prompt_embeds, renderer_workers={workers}, "
             f"{rounds} rounds, probe every {PROBE_INTERVAL * 1e3:.0f} ms",
             f"{'mode':<20} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} {'decode all':>9} {'samples':>8}   (ms)"]
    lines += [r.line() for r in results]
    by_mode = {r.mode: r for r in results}
    base, ours = by_mode["inline torch.load"], by_mode["thread ours"]
    lines.append(f"thread ours / inline torch.load: p99 {ours.percentile(0.99) / base.percentile(0.99):.3f} "
                 f"(target <= 0.1), max {max(ours.lags) / max(base.lags):.3f} (target <= 0.2)")
    return "\n".join(lines)
