"""`trio-llm bench cold-start MODEL`: seconds from launch to a healthy `trio-llm serve` on a first
start (an empty compile cache, as on a new machine) and on a warm one, and what one stream gets
while the graphs compile in the background (`serve`'s default) and after.

Round 1 starts on an empty cache directory (`--compilation-config '{"cache_dir": ...}'`: the
compiled packages and inductor's own cache, its headers included), times it to healthy, loads one
stream on the eager model, waits until the log says steps run on the compiled graphs, loads one
stream again, and stops. Rounds 2 and on start on empty directories of their own, time them to
healthy and stop (which kills their compiles: the cancellation path). Then `--repeats` restarts on
round 1's directory, the graphs saved, are timed to healthy (warm). Medians are reported; every
figure is printed.

`--warm-only` times warm starts alone, on serve's own cache: one start first, not timed, compiles
whatever is not there (`--no-compile-in-background`, so it is healthy once the graphs are saved).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.serve import LevelResult, run_level
from bench.side_by_side import SERVED_NAME, rate, served

ADOPTED = "steps run on the compiled graphs from now on"


@dataclass
class FirstStart:
    healthy: float  # seconds from launch
    adopted: float | None = None  # seconds from launch until steps ran on the compiled graphs
    eager: LevelResult | None = None  # one stream before the graphs
    compiled: LevelResult | None = None  # one stream after


def serve_command(model: str, port: int, cache_dir: Path | None, extra: list[str]) -> list[str]:
    """`trio-llm serve`'s command line; its compile cache `cache_dir` (None: serve's own)."""
    cache = [] if cache_dir is None else ["--compilation-config", f'{{"cache_dir": "{cache_dir}"}}']
    return [sys.executable, "-m", "web.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, *cache, *extra]


async def one_stream(url: str, output_len: int, vocab: int) -> LevelResult:
    return await run_level(url, SERVED_NAME, 1, 2, 128, output_len, vocab, 600.0, None, seed=7)


async def log_says(path: Path, line: str) -> bool:
    return line in await trio.Path(path).read_text(errors="replace")


async def first_start(model: str, port: int, cache_dir: Path, extra: list[str], log: Path, wait: bool,
                      output_len: int, vocab: int) -> FirstStart:
    launched = time.perf_counter()
    async with served("trio-llm", serve_command(model, port, cache_dir, extra), port, str(log)) as (url, healthy):
        result = FirstStart(healthy)
        if wait:
            result.eager = await one_stream(url, output_len, vocab)
            with trio.fail_after(3600):
                # Polling the server's log: another process writes it, there is nothing to await.
                while not await log_says(log, ADOPTED):  # noqa: ASYNC110
                    await trio.sleep(0.5)
            result.adopted = time.perf_counter() - launched
            result.compiled = await one_stream(url, output_len, vocab)
        return result


async def warm_start(model: str, port: int, cache_dir: Path | None, extra: list[str], log: Path) -> float:
    async with served("trio-llm", serve_command(model, port, cache_dir, extra), port, str(log)) as (_, healthy):
        return healthy


async def run(model: str, extra: list[str], repeats: int, output_len: int, vocab: int, port: int = 8190) -> str:
    with tempfile.TemporaryDirectory(prefix="cold-start-") as scratch:
        root = Path(scratch)
        firsts = [await first_start(model, port, root / "round-1", extra, root / "first-1.log", True,
                                    output_len, vocab)]
        for i in range(2, repeats + 1):
            firsts.append(await first_start(model, port, root / f"round-{i}", extra, root / f"first-{i}.log", False,
                                            output_len, vocab))
        warms = [await warm_start(model, port, root / "round-1", extra, root / f"warm-{i}.log")
                 for i in range(repeats)]
    return report(model, extra, repeats, firsts, warms)


async def run_warm(model: str, extra: list[str], repeats: int, port: int = 8190) -> str:
    """Warm starts on serve's own cache, after one start (not timed) that fills it."""
    with tempfile.TemporaryDirectory(prefix="warm-start-") as scratch:
        logs = Path(scratch)
        await warm_start(model, port, None, [*extra, "--no-compile-in-background"], logs / "priming.log")
        warms = [await warm_start(model, port, None, extra, logs / f"warm-{i}.log") for i in range(repeats)]
    return "\n".join([f"model={model} trio-llm serve {' '.join(extra)} (serve's own compile cache); rounds={repeats}",
                      _warm_line(warms)])


def _warm_line(warms: list[float]) -> str:
    return f"warm start to healthy: median {statistics.median(warms):.1f} s ({', '.join(f'{w:.1f}' for w in warms)})"


def report(model: str, extra: list[str], repeats: int, firsts: list[FirstStart], warms: list[float]) -> str:
    first = firsts[0]
    assert first.eager is not None and first.compiled is not None and first.adopted is not None
    return "\n".join([
        f"model={model} trio-llm serve {' '.join(extra)} (compile in the background: serve's default); "
        f"rounds={repeats}",
        f"first start to healthy (empty cache): median {statistics.median(f.healthy for f in firsts):.1f} s "
        f"({', '.join(f'{f.healthy:.1f}' for f in firsts)})",
        f"first start until steps run on the compiled graphs: {first.adopted:.1f} s (round 1)",
        f"one stream meanwhile, eager: {rate(first.eager):.1f} tok/s; after, compiled: {rate(first.compiled):.1f} "
        f"tok/s",
        _warm_line(warms),
    ])
