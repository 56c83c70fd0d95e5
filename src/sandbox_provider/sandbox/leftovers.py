"""
``SandboxRecord``: one sandbox as a backend finds it again, in the same shape on every backend.

A sweep (``airflow sandboxes``, :func:`sandbox_provider.cli.sweep.sweep`) judges records only: what
it reads of a sandbox is its handle, its stamps (expiry, owner, holder, and the Dag, run, task, map
index and try that made it), and, where the backend knows them, its state and when it was made.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    MAP_INDEX_TAG,
    OWNER_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
)

__all__ = ["SandboxRecord"]


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class SandboxRecord:
    """
    One sandbox of this provider, as its backend lists it.

    :param handle: the sandbox's handle.
    :param stamps: its stamps, strings (see :mod:`sandbox_provider.sandbox.spec`); those a backend
        cannot keep are missing.
    :param state: the backend's word for its state (``running``, ``exited``, ...), or None if unknown.
    :param created_at: Unix time (seconds) it was made, or None if unknown.
    """

    handle: str
    stamps: Mapping[str, str] = field(default_factory=dict)
    state: str | None = None
    created_at: float | None = None

    @property
    def expires_at(self) -> float | None:
        """Unix time (seconds) its lifetime ends, or None if it carries no readable expiry."""
        return _number(self.stamps.get(EXPIRES_AT_TAG))

    @property
    def owner(self) -> str | None:
        """Its owner stamp (a sandbox kept for later tasks), or None."""
        return self.stamps.get(OWNER_TAG) or None

    @property
    def holder(self) -> str | None:
        """The task instance attached to it now, or None."""
        return self.stamps.get(HOLDER_TAG) or None

    @property
    def made_by(self) -> dict[str, str]:
        """The task instance that made it: ``dag_id``, ``run_id``, ``task_id``, ``map_index``, ``try_number`` found."""
        keys = {
            "dag_id": DAG_ID_TAG,
            "run_id": RUN_ID_TAG,
            "task_id": TASK_ID_TAG,
            "map_index": MAP_INDEX_TAG,
            "try_number": TRY_NUMBER_TAG,
        }
        return {name: self.stamps[tag] for name, tag in keys.items() if self.stamps.get(tag)}

    def expired(self, now: float | None = None) -> bool:
        """True when its lifetime has run out at ``now`` (Unix seconds; default: the current time)."""
        expires = self.expires_at
        return expires is not None and expires <= (time.time() if now is None else now)

    def age(self, now: float | None = None) -> float | None:
        """Seconds since it was made, at ``now``; None if the backend does not know when."""
        if self.created_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.created_at)

    def lifetime_left(self, now: float | None = None) -> float | None:
        """Seconds of lifetime left at ``now`` (negative once past it); None without an expiry."""
        expires = self.expires_at
        return None if expires is None else expires - (time.time() if now is None else now)
