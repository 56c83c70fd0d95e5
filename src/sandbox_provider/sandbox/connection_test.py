"""
Who a connection test is for and which process runs it, for the messages of ``test_connection``.

Airflow runs a hook's ``test_connection`` wherever the test was asked for: the UI's Test button
and ``POST /api/v2/connections/test`` run it inside the API server, ``airflow connections test``
inside the CLI process. The API server does not hand the hook the connection's id: it tests a copy
stored under a random temporary id (exported as ``AIRFLOW_CONN_<temporary id>`` for the length of
the test). A message that named that id, or "the worker", would send the reader looking in the
wrong place, so :func:`connection_test_origin` recovers both facts once per test.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from dataclasses import dataclass
from types import FrameType

__all__ = ["ConnectionTestOrigin", "connection_test_origin"]

#: How many callers up the stack to look for the API server's test route.
_MAX_FRAMES = 12


@dataclass(frozen=True)
class ConnectionTestOrigin:
    """
    Where a connection test comes from.

    :param conn_id: the id the hook was given (Airflow's temporary id in the API server), or None.
    :param tested_id: the id of the connection the person asked to test (equal to ``conn_id``
        outside the API server), or None when the hook has no connection.
    :param runner: the process running the test, for a message: ``"the API server (pid 4242 on
        host web-1)"`` or ``"airflow connections test (pid 4242 on host web-1)"``.
    """

    conn_id: str | None
    tested_id: str | None
    runner: str

    def name_tested(self, message: str) -> str:
        """``message`` with every quoted mention of the temporary id replaced by the tested id."""
        if not self.conn_id or not self.tested_id or self.conn_id == self.tested_id:
            return message
        return message.replace(repr(self.conn_id), repr(self.tested_id))


def connection_test_origin(conn_id: str | None, *, frame: FrameType | None = None) -> ConnectionTestOrigin:
    """
    Describe the connection test that is running now, from inside a hook's ``test_connection``.

    The API server's test route (Airflow 3.2 and 3.3) keeps the temporary id in a local named
    ``transient_conn_id`` and the request in ``test_body``; the frame of that caller, found by both
    and by the temporary id being ``conn_id``, gives the id the person tested and shows that the
    API server runs the test. Anywhere else (or if a later Airflow renames those), ``conn_id`` is
    the tested id and the process is named by its program.

    :param conn_id: the connection id the hook was built with.
    :param frame: the frame to search upwards from; default the caller's.
    """
    where = f"pid {os.getpid()} on host {socket.gethostname()}"
    if frame is None:
        here = inspect.currentframe()
        frame = here.f_back if here is not None else None
    tested = _tested_in_api_server(conn_id, frame) if conn_id else None
    if tested is not None:
        return ConnectionTestOrigin(conn_id, tested, f"the API server ({where})")
    return ConnectionTestOrigin(conn_id, conn_id, f"{_program()} ({where})")


def _tested_in_api_server(conn_id: str, frame: FrameType | None) -> str | None:
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        names = frame.f_locals
        if names.get("transient_conn_id") == conn_id:
            tested = getattr(names.get("test_body"), "connection_id", None)
            if isinstance(tested, str) and tested:
                return tested
        frame = frame.f_back
    return None


def _program() -> str:
    """The running program as a person would type it: ``airflow connections test``, ``pytest``."""
    argv = [arg for arg in sys.argv if arg]
    if not argv or argv[0] == "-c":
        return "this process"
    name = os.path.basename(argv[0])
    if name == "__main__.py":  # python -m <package>
        name = os.path.basename(os.path.dirname(argv[0]))
    if name == "airflow":
        words = [arg for arg in argv[1:3] if not arg.startswith("-")]
        return " ".join([name, *words])
    return name
