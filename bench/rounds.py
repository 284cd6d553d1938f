"""Rounds that alternate which side goes first, for benchmarks that compare sides in one process."""

from __future__ import annotations

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
