"""The ``docker`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.hooks.forms._egress import EGRESS_SETTINGS
from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_SANDBOX_TIMEOUT = 3600
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_BYTES = 1024**3
DEFAULT_PIDS_LIMIT = 512
#: The user commands run as by default: an id no account of a common image has.
DEFAULT_SANDBOX_UID = 65432

SETTINGS = SettingsTable(
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Default image",
        help="Image the sandboxes run; it needs sh, sleep, cp, chmod, chown, mkdir and coreutils timeout. When the Engine does not have it, "
        "it is pulled from its registry (unless pull is never): an Engine without registry access needs an "
        "image it already has, e.g. airflow-sandbox-python:bookworm from scripts/docker/prepare.sh.",
    ),
    Setting(
        "network",
        str,
        "bridge",
        label="Network for block_network=False",
        help="Docker network a sandbox joins when its spec sets block_network=False.",
    ),
    Setting("cpus", float, DEFAULT_CPUS, label="CPUs", help="CPUs per sandbox; fractions allowed.", minimum=0.001),
    Setting(
        "memory_bytes",
        int,
        DEFAULT_MEMORY_BYTES,
        label="Memory limit (bytes)",
        help="Memory per sandbox in bytes, swap included.",
        default_text=f"{DEFAULT_MEMORY_BYTES} (1 GiB)",
        unit="bytes",
        minimum=6 * 1024 * 1024,
    ),
    Setting(
        "pids_limit", int, DEFAULT_PIDS_LIMIT, label="Process limit", help="Processes per sandbox at once.", minimum=1
    ),
    Setting(
        "sandbox_timeout",
        float,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds a sandbox may live; after it, the Engine stops and removes the container.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "sandbox_uid",
        int,
        DEFAULT_SANDBOX_UID,
        label="Command user id",
        help="User id commands and file operations run as, with no capabilities; pick one no account of the "
        "image uses. Its group id is the same number.",
        minimum=1,
        maximum=2**31 - 2,
    ),
    Setting(
        "run_as_root",
        bool,
        False,
        label="Run commands as root",
        help="Run commands as root with a few capabilities (for jobs that install packages). Root commands can "
        "stop the sandbox's keeper; the lifetime is then enforced only by the sweep at each create and by "
        "remove_expired(). Not for untrusted code.",
    ),
    Setting(
        "disk_bytes",
        int,
        label="Disk limit (bytes)",
        help=(
            "Most bytes a sandbox may write to its filesystem, through the Engine's storage-opt size. Only "
            "some storage drivers support it (overlay2 on xfs with pquota, btrfs, zfs, devicemapper); "
            "elsewhere create refuses. btrfs counts the image's files in it too."
        ),
        default_text="no limit",
        unit="bytes",
        minimum=1024 * 1024,
    ),
    Setting(
        "tls_ca_cert",
        str,
        label="TLS CA certificate (path)",
        help=(
            "Path of the CA certificate the daemon's is checked against, on every host that uses this "
            "connection (workers, and the API server for the Test button)."
        ),
    ),
    Setting(
        "tls_client_cert",
        str,
        label="TLS client certificate (path)",
        help="Path of the client certificate to present; needs the client key too.",
    ),
    Setting(
        "tls_client_key",
        str,
        label="TLS client key (path)",
        help="Path of the client certificate's key.",
    ),
    Setting(
        "tls_verify",
        bool,
        label="Verify TLS",
        help="Check the daemon's certificate.",
        default_text="checked when a CA certificate is given",
    ),
    Setting(
        "pull",
        str,
        "missing",
        label="Image pull policy",
        help=(
            "When the Engine pulls a sandbox's image from its registry: missing (only when it lacks the image), "
            "never (refuse an image it lacks: for an Engine without registry access) or always (before each create)."
        ),
        choices=("missing", "never", "always"),
    ),
    *EGRESS_SETTINGS,
)
UI_BEHAVIOUR = {
    "hidden-fields": ["port", "schema"],
    "relabeling": {"host": "Docker daemon address", "login": "Registry user", "password": "Registry password"},
    "placeholders": {
        "host": "unix:///var/run/docker.sock or tcp://host:2376 (default: DOCKER_HOST, else the local socket)",
        "login": "only to pull a missing image (default: anonymous)",
        "password": "only to pull a missing image",
    },
}

FORM = ConnectionForm(
    conn_type="sandbox_docker",
    hook_name="Sandbox (Docker Engine)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
)
