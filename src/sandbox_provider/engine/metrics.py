"""
Airflow metrics of the sandbox steps, sent through Airflow's ``Stats`` from this module only.

The session engine (:mod:`~sandbox_provider.engine.session`) calls these functions around each step it
drives, for every consumer and every backend; no backend sends a metric of its own. Each metric is
tagged with the backend's short name (``backend``: ``local``, ``docker``, ...) and, when the hook was
made from a connection, its id (``conn_id``). Tags reach the metrics backends that carry them
(OpenTelemetry, Datadog, StatsD with InfluxDB tags); plain StatsD keeps the names only.

Timers (milliseconds, sent when the step succeeded):

- ``sandbox.create``: provisioning a sandbox (``SandboxHook.create``);
- ``sandbox.stage``: writing files and inputs in, as a step of its own;
- ``sandbox.run``: one command, from launch to its end; tagged ``staged`` (``true`` when the files went in
  with the command's own launch, whose time is then part of this one and sends no ``sandbox.stage``);
- ``sandbox.export``: copying the exports out and publishing them;
- ``sandbox.destroy``: removing the sandbox.

Counters:

- ``sandbox.refusals``: a spec the backend cannot enforce, refused before anything was provisioned;
- ``sandbox.timeouts``: a command killed at its deadline;
- ``sandbox.failures``: a step that failed, tagged ``step`` (``create``, ``attach``, ``stage``, ``run``,
  ``export``, ``destroy``); a command that exits non-zero is the job's failure, not the sandbox's, and
  is not counted;
- ``sandbox.leftovers_swept``: sandboxes removed because nothing else would (left by an earlier try of
  the task, or found by a sweep), counted by :func:`count_leftovers_swept`.

A metric never fails a task: an error while sending one is logged and dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "COUNTERS",
    "STEPS",
    "TIMERS",
    "count",
    "count_leftovers_swept",
    "metric_tags",
    "timed",
]

#: The steps the engine times, each the timer ``sandbox.<step>``.
STEPS: tuple[str, ...] = ("create", "stage", "run", "export", "destroy")
#: Every timer's name.
TIMERS: tuple[str, ...] = tuple(f"sandbox.{step}" for step in STEPS)
#: Every counter's name.
COUNTERS: tuple[str, ...] = ("sandbox.refusals", "sandbox.timeouts", "sandbox.failures", "sandbox.leftovers_swept")


def metric_tags(hook: Any) -> dict[str, str]:
    """``{"backend": <short name>, "conn_id": <connection id>}`` for ``hook``; no ``conn_id`` without a connection."""
    tags = {"backend": str(getattr(hook, "name", "sandbox"))}
    conn_attr = getattr(hook, "conn_name_attr", None)
    conn_id = getattr(hook, conn_attr, None) if isinstance(conn_attr, str) else None
    if isinstance(conn_id, str) and conn_id:
        tags["conn_id"] = conn_id
    return tags


def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


def _send(what: Callable[[Any], None], name: str) -> None:
    try:
        what(_stats())
    except Exception:  # a metrics backend that is down or misconfigured never fails the job
        log.debug("Could not send the metric %s", name, exc_info=True)


def count(name: str, hook: Any, *, value: int = 1, **tags: str) -> None:
    """Add ``value`` to the counter ``name`` (one of :data:`COUNTERS`), tagged for ``hook`` and with ``tags``."""
    if name not in COUNTERS:
        raise ValueError(f"{name!r} is not a sandbox counter; the counters are {', '.join(COUNTERS)}.")
    merged = {**metric_tags(hook), **tags}
    _send(lambda stats: stats.incr(name, value, tags=merged), name)


def count_leftovers_swept(hook: Any, removed: int) -> None:
    """
    Count ``removed`` sandboxes of ``hook``'s backend that a sweep removed (``sandbox.leftovers_swept``):
    what an earlier try left running, or what an operator's sweep found past its lifetime. Nothing is
    sent for 0.
    """
    if removed > 0:
        count("sandbox.leftovers_swept", hook, value=int(removed))


@contextlib.contextmanager
def timed(step: str, hook: Any, *, clock: Callable[[], float] = time.monotonic, **tags: str) -> Iterator[None]:
    """
    Time the block as the step ``step``: the timer ``sandbox.<step>`` (milliseconds; for ``step`` in
    :data:`STEPS`) when it ends normally, with ``tags`` added to the hook's; ``sandbox.failures`` tagged
    ``step`` when it raises (``attach`` is counted that way but not timed). An interrupt (Ctrl-C, the
    interpreter exiting) is neither.
    """
    started = clock()
    try:
        yield
    except Exception:
        count("sandbox.failures", hook, step=step)
        raise
    if step in STEPS:
        elapsed = timedelta(seconds=max(0.0, clock() - started))
        merged = {**metric_tags(hook), **tags}
        _send(lambda stats: stats.timing(f"sandbox.{step}", elapsed, tags=merged), f"sandbox.{step}")
