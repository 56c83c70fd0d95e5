"""
Interleaved A/B timing for the benchmark scripts: both sides run in one process, alternating
(A, B, A, B, ...), so drift of the machine (cache, load, CPU clock) lands on both; each round gives a
ratio, and the figures are the median, min and max of those ratios.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["Comparison", "Row", "attempt", "compare", "load", "print_table", "print_rows"]


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


#: One line of a table: the comparison and its goal (or a note).
Row = tuple[Comparison, str]


def load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes, as ``load 0.42/0.40/0.38``."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f}/{five:.2f}/{fifteen:.2f}"


def attempt(name: str, measure: Callable[[], Row | list[Row]]) -> Iterator[Row]:
    """
    Yield the row (or rows) ``measure()`` returns; if it raises, print one line naming ``name`` and
    the error (the traceback to standard error) and yield nothing, so the rows after it still run.
    """
    start = time.perf_counter()
    try:
        got = measure()
    except Exception as err:  # a benchmark reports a failed row and goes on
        print(
            f"{name:<34} FAILED after {time.perf_counter() - start:.1f} s: {type(err).__name__}: {err}"[:400],
            flush=True,
        )
        traceback.print_exc()
        return
    yield from (got if isinstance(got, list) else [got])


def print_rows(rows: Iterable[Row]) -> list[Row]:
    """Print each row as soon as it is measured (with the load at that moment); return them all."""
    done: list[Row] = []
    for comparison, goal in rows:
        print(f"{comparison.row(goal)} [{load()}]", flush=True)
        done.append((comparison, goal))
    return done


def print_table(rows: Iterable[Row]) -> None:
    """Print one line per comparison, with its goal, each as it comes."""
    print_rows(rows)
