"""
Interleaved A/B timing for the benchmark scripts: both sides run in one process, alternating
(A, B, A, B, ...), so drift of the machine (cache, load, CPU clock) lands on both; each round gives a
ratio, and the figures are the median, min and max of those ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Comparison", "compare", "print_table"]


@dataclass(frozen=True)
class Comparison:
    """One measured pair: ``ours`` against ``baseline``, seconds per round and the per-round ratio."""

    name: str
    baseline_name: str
    ours: list[float]
    baseline: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.baseline, strict=True)]

    def row(self, goal: str = "") -> str:
        r = self.ratios
        return (
            f"{self.name:<34} {statistics.median(self.ours) * 1000:9.1f} ms  vs {self.baseline_name:<26} "
            f"{statistics.median(self.baseline) * 1000:9.1f} ms  ratio median {statistics.median(r):5.2f}x "
            f"(min {min(r):.2f}, max {max(r):.2f}, n={len(r)}) {goal}"
        )


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(
    name: str,
    ours: Callable[[], object],
    baseline_name: str,
    baseline: Callable[[], object],
    *,
    rounds: int = 7,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> Comparison:
    """
    Time ``ours`` and ``baseline`` alternately for ``rounds`` rounds (at least 5), after ``warmup``
    untimed rounds of each; a round starts with ``ours`` on even rounds and ``baseline`` on odd ones.
    ``setup``, when given, runs untimed before every call of either side (to clear what the last
    call left, say, so neither side pays for the other's).
    """
    if rounds < 5:
        raise ValueError("use at least 5 rounds")

    def timed(fn: Callable[[], object]) -> float:
        if setup is not None:
            setup()
        return _time(fn)

    for _ in range(warmup):
        timed(ours)
        timed(baseline)
    mine: list[float] = []
    theirs: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            mine.append(timed(ours))
            theirs.append(timed(baseline))
        else:
            theirs.append(timed(baseline))
            mine.append(timed(ours))
    return Comparison(name, baseline_name, mine, theirs)


def print_table(rows: list[tuple[Comparison, str]]) -> None:
    """Print one line per comparison, with its goal."""
    for comparison, goal in rows:
        print(comparison.row(goal), flush=True)
