"""The ``sbx`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_MEMORY = "2g"
DEFAULT_SANDBOX_TIMEOUT = 3600.0
#: What ``host_network_policy`` may say about the worker host's ``sbx policy``.
HOST_POLICIES = ("unknown", "deny-all", "allow-all")

SETTINGS = SettingsTable(
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Template image",
        help="Image sandboxes start from (--template); it needs sh, setsid, sleep and mktemp, and stat, head and "
        "find for files.",
    ),
    Setting(
        "memory",
        str,
        DEFAULT_MEMORY,
        label="Memory",
        help="Memory per sandbox in binary units ('2g', '1536m'); at least 1 GiB, as sbx requires.",
    ),
    Setting("cpus", int, label="CPUs", help="CPUs per sandbox.", default_text="what sbx picks", minimum=1),
    Setting("sbx_path", str, "sbx", label="sbx binary", help="The sbx CLI: a name on PATH or a path on the worker."),
    Setting(
        "host_network_policy",
        str,
        "unknown",
        label="Host network policy",
        help="What 'sbx policy' on the worker host is: 'deny-all' after 'sbx policy init deny-all', 'allow-all', or "
        "'unknown'. sbx applies egress rules host-wide, so only a deny-all host can keep a sandbox offline.",
        choices=HOST_POLICIES,
    ),
    Setting(
        "create_timeout",
        float,
        600.0,
        label="Create timeout (seconds)",
        help="Seconds 'sbx create' may take.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "cli_grace",
        float,
        30.0,
        label="CLI grace (seconds)",
        help="Seconds past a command's deadline the CLI may take to return; after that the sandbox is destroyed.",
        unit="seconds",
        minimum=0.1,
    ),
    Setting(
        "sandbox_timeout",
        float,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds a sandbox may live. sbx has no lifetime of its own: commands are cut to what is left, and "
        "remove_expired() deletes sandboxes past it.",
        unit="seconds",
        minimum=1,
    ),
)
UI_BEHAVIOUR = {"hidden-fields": ["host", "port", "schema", "login", "password"], "relabeling": {}}

FORM = ConnectionForm(
    conn_type="sandbox_sbx",
    hook_name="Sandbox (Docker Sandboxes sbx)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
    conn_name_attr="sbx_conn_id",
)
