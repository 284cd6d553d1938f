"""`python -m bench.burst_handover`: what the event loop pays to take one step of a streamed burst.

A decode burst in process hands each step's tokens to the loop as it samples them
(engine/executor/streamed_burst.py). In the served layout the loop shares the compute CPU with the
worker thread, so whatever the loop spends a step comes out of the steps. This runs a burst of
`--steps` fake steps (each a `--step-us` spin in the worker thread, holding the GIL as the served
graphs do) with a consumer that only counts, and prints the loop thread's CPU time a step beside
the floor: the same thread posting a no-op `run_sync_soon` callback a step (trio's wake-up alone).
Rounds alternate which goes first; medians of `--rounds`. Run it under `taskset -c 1` to share one
CPU, as served.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import anyio
import trio

from bench.rounds import alternating, median_and_rounds
from engine.executor.streamed_burst import StreamedBurst
from engine.sched.output import ModelRunnerOutput, SchedulerOutput


def _spin(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def _steps(count: int, step_s: float, hand_over: Callable[[ModelRunnerOutput], bool]) -> ModelRunnerOutput:
    out = ModelRunnerOutput()
    for k in range(count):
        _spin(step_s)
        out.steps_run += 1
        if not hand_over(ModelRunnerOutput(sampled_token_ids={"a": [k]})):
            break
    return out


async def streamed(count: int, step_s: float) -> float:
    """Loop CPU seconds a step, through `StreamedBurst`."""
    taken = 0

    def on_step(step: ModelRunnerOutput) -> bool:
        nonlocal taken
        taken += 1
        return True

    burst = StreamedBurst(lambda sched_out, post: _steps(count, step_s, post), SchedulerOutput(num_steps=count),
                          anyio.CapacityLimiter(1))
    before = time.thread_time()
    await burst.run(on_step)
    assert taken == count
    return (time.thread_time() - before) / count


async def floor(count: int, step_s: float) -> float:
    """Loop CPU seconds a step for a bare `run_sync_soon` of a no-op from the worker thread."""
    token = trio.lowlevel.current_trio_token()

    def post(step: ModelRunnerOutput) -> bool:
        token.run_sync_soon(lambda: None)
        return True

    before = time.thread_time()
    await anyio.to_thread.run_sync(_steps, count, step_s, post)
    return (time.thread_time() - before) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--step-us", type=float, default=300.0, help="each fake step's spin")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sides = {"StreamedBurst": streamed, "floor (bare run_sync_soon)": floor}
    figures = alternating({name: partial(trio.run, side, args.steps, args.step_us / 1e6)
                           for name, side in sides.items()}, args.rounds)
    print(f"CPUs {sorted(os.sched_getaffinity(0))}; {args.steps} steps of {args.step_us:.0f} us, "
          f"median of {args.rounds} alternating rounds")
    for name, values in figures.items():
        median, rounds = median_and_rounds([1e6 * v for v in values], "6.1f")
        print(f"{name:28s} loop CPU {median} us a step ({rounds})")


if __name__ == "__main__":
    main()
