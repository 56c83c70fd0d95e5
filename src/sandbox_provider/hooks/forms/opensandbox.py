"""The ``opensandbox`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_SANDBOX_TIMEOUT = 3600.0
#: The OpenSandbox server refuses a shorter lifetime (HTTP 422).
MIN_SANDBOX_TIMEOUT = 60.0

SETTINGS = SettingsTable(
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Default image",
        help="Image sandboxes run; the server pulls it when its Docker Engine or cluster lacks it.",
    ),
    Setting("cpu", str, "1", label="CPU limit", help="CPU limit per sandbox, as the server reads it ('1', '500m')."),
    Setting(
        "memory", str, "2Gi", label="Memory limit", help="Memory limit per sandbox, as the server reads it ('2Gi')."
    ),
    Setting(
        "sandbox_timeout",
        float,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds before the server removes the sandbox, even if the worker died; the server's minimum is 60.",
        unit="seconds",
        minimum=MIN_SANDBOX_TIMEOUT,
    ),
    Setting(
        "request_timeout",
        float,
        30.0,
        label="Request timeout (seconds)",
        help="Seconds one API request may take (command output streams are not bound by it).",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "ready_timeout",
        float,
        120.0,
        label="Ready timeout (seconds)",
        help="Seconds a new or reconnected sandbox may take to answer; not charged to any command.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "use_server_proxy",
        bool,
        False,
        label="Reach sandboxes through the server",
        help="Send command and file traffic through the server's proxy instead of straight to each sandbox's "
        "published port (for workers that cannot reach those ports).",
    ),
)
UI_BEHAVIOUR = {
    "hidden-fields": ["login", "extra"],
    "relabeling": {"host": "Server host", "port": "Server port", "schema": "Protocol", "password": "API key"},
    "placeholders": {"host": "opensandbox.example.com", "port": "8080", "schema": "http or https"},
}

FORM = ConnectionForm(
    conn_type="sandbox_opensandbox",
    hook_name="Sandbox (OpenSandbox server)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
    conn_name_attr="opensandbox_conn_id",
)
