"""Rounds that alternate which side goes first, for benchmarks that compare sides in one process."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping


def alternating(sides: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each side's figure from `rounds` rounds, in the order of `sides` in even rounds and reversed
    in odd ones, so that neither side always runs first (warmer, or after the other's mess)."""
    figures: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(rounds):
        order = list(sides) if index % 2 == 0 else list(reversed(list(sides)))
        for name in order:
            figures[name].append(sides[name]())
    return figures


def median_and_rounds(values: list[float], spec: str) -> tuple[str, str]:
    """A side's median and its rounds in order, each formatted by `spec` ("6.1f", say), for printing
    side by side."""
    return format(statistics.median(values), spec), ", ".join(format(v, spec.lstrip("0123456789")) for v in values)
