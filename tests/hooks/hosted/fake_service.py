"""
What the stand-ins for hosted services (Islo, Boat) share: injected faults per route, the record of
the requests that reached the service, and ending a command's process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Fault:
    """
    How the next ``times`` requests on ``route`` fail: an HTTP ``status`` (with ``retry_after``)
    before the request takes effect, or ``after`` it did; a response dropped after it took effect
    (``drop``); a connection that never reaches the service (``connect``) or is never answered
    (``hang``); or a canned 200 answer (``body``).
    """

    route: str
    status: int | None = None
    after: bool = False
    drop: bool = False
    connect: bool = False
    hang: bool = False
    retry_after: str | None = None
    times: int = 1
    #: Answer 200 with this JSON instead of serving the request.
    body: dict[str, Any] | None = None


class FaultInjection:
    """Mixin for a stand-in service: :meth:`fail`, :meth:`count` and ``attempts`` (``(method, route)`` each)."""

    def __init__(self) -> None:
        self.attempts: list[tuple[str, str]] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def fail(self, route: str, **kwargs: Any) -> None:
        """Make the next ``times`` requests on ``route`` fail as :class:`Fault` says (``ROUTES`` lists the routes)."""
        self._faults.append(Fault(route, **kwargs))

    def count(self, route: str) -> int:
        """Requests on ``route`` that reached the service (connection failures excluded)."""
        return sum(1 for _, r in self.attempts if r == route)

    def take_fault(self, route: str) -> Fault | None:
        """The fault the next request on ``route`` meets, if any (each counts down its ``times``)."""
        with self._lock:
            for fault in self._faults:
                if fault.route == route and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (what it started too); a group that is gone is fine."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_running(processes: Any) -> None:
    """End the process group of each of ``processes`` (``subprocess.Popen``) that still runs."""
    for process in processes:
        if isinstance(process, subprocess.Popen) and process.poll() is None:
            kill_group(process.pid)
