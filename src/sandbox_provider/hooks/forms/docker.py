"""The ``docker`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_SANDBOX_TIMEOUT = 3600
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_BYTES = 1024**3
DEFAULT_PIDS_LIMIT = 512

SETTINGS = SettingsTable(
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Default image",
        help="Image sandboxes run; it needs sh, sleep and coreutils timeout. It is pulled when missing "
        "(pull='missing').",
    ),
    Setting(
        "network",
        str,
        "bridge",
        label="Network for block_network=False",
        help="Docker network a sandbox joins when its spec opens the network.",
    ),
    Setting("cpus", float, DEFAULT_CPUS, label="CPUs", help="CPUs per sandbox; fractions allowed.", minimum=0.001),
    Setting(
        "memory_bytes",
        int,
        DEFAULT_MEMORY_BYTES,
        label="Memory limit (bytes)",
        help="Memory per sandbox in bytes, swap included.",
        unit="bytes",
        minimum=6 * 1024 * 1024,
    ),
    Setting("pids_limit", int, DEFAULT_PIDS_LIMIT, label="Process limit", help="Processes at once.", minimum=1),
    Setting(
        "sandbox_timeout",
        float,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds before the Engine stops and removes the container.",
        unit="seconds",
        minimum=1,
    ),
    Setting("tls_ca_cert", str, label="TLS CA certificate (path)", help="CA file on the worker, for a TLS daemon."),
    Setting("tls_client_cert", str, label="TLS client certificate (path)", help="Client certificate file."),
    Setting("tls_client_key", str, label="TLS client key (path)", help="Client key file, with the certificate."),
    Setting("tls_verify", bool, label="Verify TLS", help="Verify the daemon's certificate. Default: on with a CA."),
)
UI_BEHAVIOUR = {
    "hidden-fields": ["port", "schema"],
    "relabeling": {"host": "Docker daemon address", "login": "Registry user", "password": "Registry password"},
    "placeholders": {"host": "unix:///var/run/docker.sock"},
}

FORM = ConnectionForm(
    conn_type="sandbox_docker",
    hook_name="Sandbox (Docker Engine)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
)
