"""What the connection forms of hosted services (Islo, Boat) share: the request timeout and the standard fields."""

from __future__ import annotations

from typing import Any

from sandbox_provider.sandbox.settings import Setting

#: Seconds one API request may take, by default.
DEFAULT_REQUEST_TIMEOUT = 30.0


def request_timeout(help: str) -> Setting:
    """The ``request_timeout`` setting (seconds, at least 1, default 30), with the service's own ``help``."""
    return Setting(
        "request_timeout",
        float,
        DEFAULT_REQUEST_TIMEOUT,
        label="Request timeout (seconds)",
        help=help,
        unit="seconds",
        minimum=1,
    )


def service_fields(*, host_label: str, host_placeholder: str) -> dict[str, Any]:
    """The standard fields of a service reached by URL and API key: host and password shown, the rest hidden."""
    return {
        "hidden-fields": ["login", "port", "schema"],
        "relabeling": {"host": host_label, "password": "API key"},
        "placeholders": {"host": host_placeholder},
    }
