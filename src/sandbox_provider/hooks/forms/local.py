"""The ``local`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_SANDBOX_TIMEOUT = 3600.0
DEFAULT_MAX_PROCESSES = 1024
#: The user a root worker runs sandboxes as.
DEFAULT_SANDBOX_UID = 65534
_BYTES: dict = {"kind": int, "minimum": 1, "unit": "bytes"}

SETTINGS = SettingsTable(
    Setting(
        "state_root",
        str,
        label="State directory",
        help="Directory on the worker that holds the sandboxes. Default: <temporary directory>/airflow-sandbox-<uid>.",
    ),
    Setting(
        "image",
        str,
        label="Root filesystem directory",
        help="A directory on the worker used, read-only, as the sandbox's root instead of the host's system "
        "directories (for example one made with debootstrap). Default: the host's /usr, /bin, /lib* and a few /etc "
        "entries.",
    ),
    Setting(
        "sandbox_timeout",
        float,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds a sandbox may live; after it, commands are refused and the next sweep removes it.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "cpu_seconds",
        int,
        label="CPU time per process (seconds)",
        help="CPU seconds each process in the sandbox may use (RLIMIT_CPU). Default: no limit.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "memory_bytes",
        label="Address space per process (bytes)",
        help="Virtual memory each process may map, in bytes (RLIMIT_AS). Default: no limit.",
        **_BYTES,
    ),
    Setting(
        "max_processes",
        int,
        DEFAULT_MAX_PROCESSES,
        label="Process limit",
        help="Processes the sandbox's user may have on the host at once (RLIMIT_NPROC).",
        minimum=1,
    ),
    Setting(
        "max_file_bytes",
        label="Largest file (bytes)",
        help="Largest file a process may write, in bytes (RLIMIT_FSIZE); not a quota on the total. Default: no limit.",
        **_BYTES,
    ),
    Setting(
        "sandbox_uid",
        int,
        DEFAULT_SANDBOX_UID,
        label="Sandbox user id (root workers)",
        help="Numeric id of the unprivileged user a root worker runs sandboxes as; ignored when the worker is "
        "not root. The root filesystem directory must be readable by it.",
        minimum=1,
    ),
)
UI_BEHAVIOUR = {"hidden-fields": ["host", "port", "schema", "login", "password"]}

FORM = ConnectionForm(
    conn_type="sandbox_local",
    hook_name="Sandbox (bubblewrap on the worker)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
)
