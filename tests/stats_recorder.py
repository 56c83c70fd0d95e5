"""
A metrics backend for tests: Airflow's ``Stats`` is pointed at a logger that records every metric
(name, value, tags) instead of sending it, and back at the configured one afterwards.

A plugin of the test suite (``pytest_plugins`` in ``conftest.py``): any test may ask for ``recorded_metrics``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Metric:
    kind: str  # "incr", "decr", "gauge", "timing"
    name: str
    value: Any
    tags: dict[str, Any]


@dataclass
class RecordingStats:
    """A StatsLogger that keeps what it is sent."""

    sent: list[Metric] = field(default_factory=list)

    def incr(self, stat, count=1, rate=1, *, tags=None):
        self.sent.append(Metric("incr", stat, count, dict(tags or {})))

    def decr(self, stat, count=1, rate=1, *, tags=None):
        self.sent.append(Metric("decr", stat, count, dict(tags or {})))

    def gauge(self, stat, value, rate=1, delta=False, *, tags=None):
        self.sent.append(Metric("gauge", stat, value, dict(tags or {})))

    def timing(self, stat, dt, *, tags=None):
        self.sent.append(Metric("timing", stat, dt, dict(tags or {})))

    def timer(self, stat=None, *args, tags=None, **kwargs):
        """A stopwatch as Airflow's own code uses one (``with Stats.timer() as t: ...; t.duration``)."""
        return _Timer(self, stat, dict(tags or {}))

    def named(self, prefix: str = "sandbox.") -> list[Metric]:
        """What was sent under names starting with ``prefix`` (Airflow sends metrics of its own too)."""
        return [m for m in self.sent if m.name.startswith(prefix)]


class _Timer:
    def __init__(self, recorder: RecordingStats, stat: str | None, tags: dict[str, Any]) -> None:
        self.recorder, self.stat, self.tags = recorder, stat, tags
        self.duration: float | None = None
        self._started = 0.0

    def start(self) -> _Timer:
        self._started = time.monotonic()
        return self

    def stop(self, send: bool = True) -> None:
        self.duration = (time.monotonic() - self._started) * 1000.0
        if send and self.stat:
            self.recorder.sent.append(Metric("timing", self.stat, self.duration, self.tags))

    def __enter__(self) -> _Timer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _initialize(stats: Any, factory: Any) -> None:
    """``Stats.initialize`` of Airflow 3.3 (which asks whether to send legacy names too) or of 3.2."""
    if "export_legacy_names" in inspect.signature(stats.initialize).parameters:
        stats.initialize(factory=factory, export_legacy_names=False)
    else:
        stats.initialize(factory=factory)


def _configured_factory() -> Any:
    from airflow.sdk._shared.observability.metrics import stats as module

    factory = getattr(module, "_factory", None)  # Airflow 3.3: module-level state
    if factory is None and hasattr(module, "_Stats"):  # Airflow 3.2: the metaclass holds it
        factory = type.__getattribute__(module.Stats, "factory")
    return factory


@pytest.fixture
def recorded_metrics():
    """A :class:`RecordingStats` that Airflow's ``Stats`` sends to for the test."""
    import airflow.sdk.serde  # noqa: F401 - it initializes Stats when first imported; let it do so first
    from airflow.sdk.observability.stats import Stats

    before = _configured_factory()
    recorder = RecordingStats()
    _initialize(Stats, lambda: recorder)
    try:
        yield recorder
    finally:
        from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger

        _initialize(Stats, before or NoStatsLogger)
