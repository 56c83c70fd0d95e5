"""
A Test of a hosted backend's connection answers within the Test button's patience, and creation
retries last no longer than the connection's request_timeout (issue 28): before, Islo retried a
refused connection for 180 s, then its delete for 60 s more, for a Test and for a task alike.
"""

from __future__ import annotations

import importlib
import socket
import time

import pytest

from sandbox_provider.hooks import connection_types
from sandbox_provider.sandbox.hook import TEST_PATIENCE

#: The Test button's patience the issue sets: a Test must have answered by then.
BUTTON_PATIENCE = 15.0
#: Each hosted backend's SDK, imported before the Test is timed: an import is the worker's CPU, not a wait.
SDKS = {
    "sandbox_islo": "islo",
    "sandbox_boat": "boat_sdk",
    "sandbox_opensandbox": "opensandbox",
    "sandbox_openshell": "openshell",
}


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _fields(conn_type: str, port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    return {
        "sandbox_islo": {"host": url, "password": "key", "extra": {"base_url": url}},
        "sandbox_boat": {"host": url, "password": "key", "extra": {}},
        "sandbox_opensandbox": {"host": "127.0.0.1", "port": port, "schema": "http", "password": "key", "extra": {}},
        "sandbox_openshell": {"host": "127.0.0.1", "port": port, "password": "key", "extra": {}},
    }[conn_type]


@pytest.mark.parametrize("conn_type", sorted(SDKS))
def test_a_test_against_a_closed_port_answers_within_the_buttons_patience(conn_type, closed_port, add_connection):
    fields = _fields(conn_type, closed_port)
    # A request timeout far past the patience: the patience, not the setting, must end the Test.
    extra = {**fields.pop("extra"), "request_timeout": 120}
    add_connection("unreachable", conn_type, extra=extra, **fields)
    cls = connection_types()[conn_type]
    hook = cls(**{cls.conn_name_attr: "unreachable"})
    importlib.import_module(SDKS[conn_type])
    started = time.monotonic()
    ok, message = hook.test_connection()
    took = time.monotonic() - started
    assert not ok and message.startswith("Connection 'unreachable', tested by"), message
    assert took <= BUTTON_PATIENCE, f"the Test took {took:.1f}s: {message}"
    assert not hook.testing  # the patience applies to the Test only


def test_the_patience_cuts_budgets_only_while_a_test_runs():
    hook = connection_types()["sandbox_islo"]()
    assert hook.patience(180.0) == 180.0
    seen: list[float] = []
    hook._check_connection = lambda: seen.append(hook.patience(180.0)) or "fine"
    assert hook.test_connection()[0]
    assert 0.5 <= seen[0] <= TEST_PATIENCE
    assert hook.patience(180.0) == 180.0
