"""How many intra-op threads each forward pass gets, chosen from how long the steps take.

A server shares its machine: its own HTTP process, tokenization, a log shipper, a neighbour's
job. OpenMP threads that meet at a barrier after every kernel lose the whole step whenever one of
them is preempted, so when a core is busy, fewer threads are faster than more. Measured on this
2-core machine (0.5B shape, compiled step at batch 1, docs/benchmarks.md): quiet, 2 threads 35 ms
and 1 thread 58 ms; with a busy loop on one core, 2 threads 148 ms and 1 thread 60 ms. No fixed
count is right for both, and no OpenMP wait policy rescues two threads (measured too).

So the count is measured, not guessed: steps run at the current count, and every so often a few
steps run at one thread fewer or one more (alternately, within 1..`max_threads`). Probe steps are
compared with the current count's recent steps of the same shape (tokens in the step, and the
decodes of a burst); when the probe is faster by more than `margin`, it becomes the current
count. A probe that loses makes the next one come later, so a steady machine pays little for the
probing. What a losing probe costs
decides how much later: a probe step that takes several times the current count's ends its
probe at once (two threads beside a busy neighbour lost 30-100x in served runs: one OpenMP
barrier waits out the neighbour's time slice), and the next probe waits until the steps between
make that cost at most `probe_budget` of the time. A current-count step that takes several times
its recent ones (a neighbour just arrived) brings the next probe forward to the next step.

Intervals and probes are counted in steps, where a decode burst counts its decodes, and a step
longer than `STEP_UNIT` seconds counts as one per `STEP_UNIT` of its time: a prompt step of
seconds is as much evidence, and as much of the time a wrong count wastes, as many decode steps.
Counted one each, the 0.5B shape's 2,048-token prompt chunks (10 s apiece on one thread) kept 16
streams' prompts on one thread for the first 65-70 s of a served run, the tuner waiting for its 32
steps (docs/benchmarks.md); bursts of 32 decodes put its first probe ~1,000 tokens into a run.

Plain Python, no clock of its own: the caller times the steps (tests feed it fake timings).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable

RECENT_STEPS = 8  # step times kept per step shape at the current count
HOPELESS = 2.0  # a probe step this many times slower than the current count's ends its probe
MAX_COSTLY_INTERVAL = 4096  # steps between probes, at most, however much the last one cost
STEP_UNIT = 0.1  # seconds: a longer step counts as one per this much (a burst's decodes count one each)


def step_weight(seconds: float, steps: int = 1) -> float:
    """How many steps a step of `seconds` counts as: a decode burst of `steps` decodes as many,
    a long step as its time in `STEP_UNIT`s."""
    return max(float(steps), seconds / STEP_UNIT)


class ThreadTuner:
    """The thread count for each step. `max_threads`: the most it may use (the compute CPUs, or
    torch's default); it starts there."""

    def __init__(self, max_threads: int, probe_steps: int = 4, min_interval: int = 32, max_interval: int = 256,
                 margin: float = 0.05, probe_budget: float = 0.02, start: int | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        if start is not None and not 1 <= start <= max_threads:
            raise ValueError(f"start must be between 1 and max_threads ({max_threads}), got {start}")
        self.max_threads = max_threads
        self.threads = start or max_threads  # the current count
        self.probe_steps = probe_steps
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.margin = margin
        self.probe_budget = probe_budget  # the share of step time a losing probe may cost
        self.interval = min_interval
        self.switches = 0  # how often the current count changed (logged, tests)
        self.steps = 0  # steps recorded
        self.last_probe: tuple[int, float | None] = (self.threads, None)  # (count, its time / the current's)
        self._until_probe: float = min_interval  # steps, weighted (`step_weight`)
        self._probing: int | None = None  # the count being probed
        self._probe_times: dict[Hashable, list[float]] = {}
        self._probe_weights: dict[Hashable, float] = {}  # step shape -> the probe's steps of it, weighted
        self._probe_weight = 0.0  # the probe's steps so far, weighted (`step_weight`)
        self._recent: dict[Hashable, deque[float]] = {}  # step shape -> recent seconds at the current count
        self._next_direction = -1  # fewer threads first: contention is the common reason to move

    def next_threads(self) -> int:
        """The count the next step should run with."""
        if self._probing is None and self._until_probe <= 0:
            self._probing = self._candidate()
            self._probe_times, self._probe_weights = {}, {}
            self._probe_weight = 0.0
        return self._probing if self._probing is not None else self.threads

    def record(self, threads: int, shape: Hashable, seconds: float, steps: int = 1) -> None:
        """A step of `shape` (what makes steps comparable: its tokens, say) ran `seconds` with
        `threads`; `steps`: the decodes of a burst, which count as that many steps (32 decodes a
        call on a small model would otherwise put the first probe ~1,000 tokens into a run)."""
        self.steps += 1
        weight = step_weight(seconds, steps)
        if self._probing is not None and threads == self._probing:
            self._probe_times.setdefault(shape, []).append(seconds)
            self._probe_weights[shape] = self._probe_weights.get(shape, 0.0) + weight
            self._probe_weight += weight
            recent = self._recent.get(shape)
            hopeless = recent is not None and len(recent) > 0 and seconds > HOPELESS * statistics.median(recent)
            if hopeless or self._probe_weight >= self.probe_steps:
                self._finish_probe()
            return
        if threads != self.threads:
            return  # a step from before the last switch
        recent = self._recent.setdefault(shape, deque(maxlen=RECENT_STEPS))
        if len(recent) == RECENT_STEPS and seconds > HOPELESS * statistics.median(recent):
            self._until_probe = 0  # the machine changed under us (a neighbour came): look again now
        else:
            self._until_probe -= weight
        recent.append(seconds)

    def _candidate(self) -> int | None:
        """The count to probe: one fewer or one more, alternately; None where there is no other."""
        for direction in (self._next_direction, -self._next_direction):
            candidate = self.threads + direction
            if 1 <= candidate <= self.max_threads:
                self._next_direction = -direction
                return candidate
        self._until_probe = self.max_interval  # one thread: nothing to probe, ever
        return None

    def _finish_probe(self) -> None:
        probed, self._probing = self._probing, None
        assert probed is not None
        ratios = {shape: statistics.median(times) / statistics.median(self._recent[shape])
                  for shape, times in self._probe_times.items() if self._recent.get(shape)}
        ratio = statistics.median(ratios.values()) if ratios else None
        self.last_probe = (probed, ratio)
        if ratio is not None and ratio < 1 - self.margin:
            self._next_direction = 1 if probed > self.threads else -1  # next, the same way again: it paid
            self.threads = probed
            self.switches += 1
            self._recent = {shape: deque(times, maxlen=RECENT_STEPS) for shape, times in self._probe_times.items()}
            self.interval = self.min_interval
        elif ratio is not None:
            # Later each time it loses, and as much later as it cost: its extra time, in steps.
            cost = sum(max(r - 1, 0.0) * self._probe_weights[shape] for shape, r in ratios.items())
            backed_off = min(2 * self.interval, self.max_interval)
            self.interval = min(max(backed_off, round(cost / self.probe_budget)), MAX_COSTLY_INTERVAL)
        self._until_probe = self.interval
