"""The ``openshell`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_WORKSPACE = "default"
DEFAULT_SANDBOX_TIMEOUT = 3600.0

SETTINGS = SettingsTable(
    Setting(
        "gateway",
        str,
        label="CLI gateway name",
        help="A gateway registered with the openshell CLI on the worker, used when the connection has no host.",
        default_text="$OPENSHELL_GATEWAY, else the CLI's active gateway",
    ),
    Setting("workspace", str, DEFAULT_WORKSPACE, label="Workspace", help="The gateway workspace sandboxes live in."),
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Image",
        help="Image of new sandboxes; it needs sh, setsid and sleep, and stat, head, find and mktemp for files.",
    ),
    Setting("cpu", str, "1", label="CPU limit", help="CPU limit per sandbox, as a Kubernetes quantity ('1', '500m')."),
    Setting("memory", str, "2Gi", label="Memory limit", help="Memory limit per sandbox, as a Kubernetes quantity."),
    Setting(
        "sandbox_timeout",
        float,
        unit="seconds",
        default=DEFAULT_SANDBOX_TIMEOUT,
        minimum=1,
        label="Sandbox lifetime (seconds)",
        help="Seconds a sandbox may live. The gateway has no lifetime of its own: commands are cut to what is left, "
        "and remove_expired() deletes sandboxes past it.",
    ),
    Setting(
        "ready_timeout",
        float,
        unit="seconds",
        default=120.0,
        minimum=1,
        label="Ready timeout (seconds)",
        help="Seconds a new sandbox may take to become ready.",
    ),
    Setting(
        "request_timeout",
        float,
        unit="seconds",
        default=30.0,
        minimum=0.1,
        label="Request timeout (seconds)",
        help="Seconds one gateway call other than a command may take.",
    ),
    Setting(
        "relay_grace",
        float,
        unit="seconds",
        default=30.0,
        minimum=0.1,
        label="Relay grace (seconds)",
        help="Seconds past a command's deadline the gateway may take to relay its end; after that the sandbox is "
        "destroyed.",
    ),
    Setting(
        "tls", bool, label="TLS", help="Use TLS with the system's trusted roots.", default_text="on with a CA file"
    ),
    Setting(
        "tls_ca_cert",
        str,
        label="TLS CA certificate (path)",
        help="CA file on the worker that signed the gateway.",
    ),
    Setting(
        "tls_client_cert",
        str,
        label="TLS client certificate (path)",
        help="Client certificate file, for mTLS.",
    ),
    Setting(
        "tls_client_key",
        str,
        label="TLS client key (path)",
        help="Client key file, with the certificate.",
    ),
)
UI_BEHAVIOUR = {
    "hidden-fields": ["schema", "login"],
    "relabeling": {"host": "Gateway address", "port": "Gateway port", "password": "Bearer token"},
    "placeholders": {"host": "openshell.example.com", "port": "443"},
}

FORM = ConnectionForm(
    conn_type="sandbox_openshell",
    hook_name="Sandbox (NVIDIA OpenShell gateway)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
    conn_name_attr="openshell_conn_id",
)
