"""One timed pair of a benchmark: the engine an arm is compared with, and the arm, on the same
prompts. Shared by the benchmarks that report ratios against a baseline engine."""

from __future__ import annotations

from collections.abc import Callable


def timed_pair(repeat: int, baseline: Callable[[], float],
               arm: Callable[[], float]) -> tuple[float, float]:
    """`(baseline seconds, arm seconds)`, each callable running its side once and returning how
    long it took; which side runs first alternates with `repeat`, so order effects (a warm
    allocator, a cooler machine) cancel out over repeats."""
    if repeat % 2 == 0:
        first = baseline()
        return first, arm()
    took = arm()
    return baseline(), took
