"""The ``boat`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.hooks.forms._hosted import request_timeout, service_fields
from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_SANDBOX_TIMEOUT = 3600
#: Boat archives a sandbox after at most 30 days.
MAX_SANDBOX_TIMEOUT = 30 * 24 * 3600
DEFAULT_READY_TIMEOUT = 300.0
MACHINE_TYPES = ("small", "default", "large", "xlarge")

SETTINGS = SettingsTable(
    Setting(
        "machine_type",
        str,
        "default",
        label="Machine type",
        help="Boat's machine size for a sandbox.",
        choices=MACHINE_TYPES,
    ),
    Setting(
        "sandbox_timeout",
        int,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds after which Boat archives the sandbox (its ttl_seconds, at most 30 days); snapshots are off, "
        "so its disk goes with it.",
        unit="seconds",
        minimum=60,
        maximum=MAX_SANDBOX_TIMEOUT,
    ),
    Setting(
        "ready_timeout",
        float,
        DEFAULT_READY_TIMEOUT,
        label="Ready timeout (seconds)",
        help="Seconds to wait for a new sandbox to be ready for commands.",
        unit="seconds",
        minimum=1,
    ),
    request_timeout("Seconds one API request may take, past a command's own deadline."),
)
UI_BEHAVIOUR = service_fields(host_label="API base URL", host_placeholder="https://boat.dev/api/v1")

FORM = ConnectionForm(
    conn_type="sandbox_boat",
    hook_name="Sandbox (Boat)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
    conn_name_attr="boat_conn_id",
)
