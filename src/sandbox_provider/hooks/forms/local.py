"""The ``local`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.hooks.forms._egress import EGRESS_SETTINGS
from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_SANDBOX_TIMEOUT = 3600.0
DEFAULT_MAX_PROCESSES = 1024
#: /dev/shm of each command, in bytes (Docker's default).
DEFAULT_SHM_BYTES = 64 * 1024 * 1024
#: The host user ids a root worker leases to its sandboxes (see hooks/local/ids.py).
DEFAULT_UID_RANGE = "1900000000-1900065535"
DEFAULT_CGROUP_PARENT = "airflow-sandbox"
_BYTES: dict = {"kind": int, "minimum": 1, "unit": "bytes"}

SETTINGS = SettingsTable(
    Setting(
        "state_root",
        str,
        label="State directory",
        help="Directory on the worker that holds the sandboxes.",
        default_text="<temporary directory>/airflow-sandbox-<uid>-<instance>, one per user and AIRFLOW_HOME",
    ),
    Setting(
        "image",
        str,
        label="Root filesystem directory",
        help=(
            "A directory on the worker used, read-only, as the sandbox's root instead of the host's system "
            "directories (for example one made with debootstrap); on a root worker every user must be able to"
            " read it."
        ),
        default_text="the host's /usr, /bin, /lib* and a few /etc entries",
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
        help="CPU seconds each process in the sandbox may use (RLIMIT_CPU).",
        default_text="no limit",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "cpu_limit",
        float,
        label="CPU share (CPUs)",
        help=(
            "CPU time the whole sandbox may use per second of wall-clock time, in CPUs (0.5 = half a core; "
            "cgroup cpu.max). Needs a writable cgroup hierarchy: refused without one."
        ),
        default_text="no limit",
        unit="CPUs",
        minimum=0.01,
    ),
    Setting(
        "memory_bytes",
        label="Memory limit (bytes)",
        help=(
            "Memory of the whole sandbox, in bytes: its processes, the files it keeps in /dev/shm and its "
            "tmpfs, and its page cache (cgroup memory.max). Needs a writable cgroup hierarchy: refused "
            "without one."
        ),
        default_text="no limit",
        **_BYTES,
    ),
    Setting(
        "max_processes",
        int,
        DEFAULT_MAX_PROCESSES,
        label="Process limit",
        help="Processes and threads the sandbox may have at once (cgroup pids.max; without cgroups, RLIMIT_NPROC "
        "of the sandbox's user).",
        minimum=1,
    ),
    Setting(
        "max_file_bytes",
        label="Largest file (bytes)",
        help="Largest file a process may write, in bytes (RLIMIT_FSIZE); not a quota on the total.",
        default_text="no limit",
        **_BYTES,
    ),
    Setting(
        "disk_bytes",
        label="Disk budget (bytes)",
        help=(
            "Bytes the sandbox may store in its workspace and /tmp together: they live on a tmpfs of this "
            "size (held in memory, counted in memory_bytes). Needs a root worker: refused otherwise."
        ),
        default_text="no limit",
        **_BYTES,
    ),
    Setting(
        "shm_bytes",
        int,
        DEFAULT_SHM_BYTES,
        label="/dev/shm size (bytes)",
        help="Size of the sandbox's /dev/shm, a fresh tmpfs for each command, in bytes.",
        unit="bytes",
        minimum=4096,
    ),
    Setting(
        "uid_range",
        str,
        DEFAULT_UID_RANGE,
        label="Sandbox user ids (root workers)",
        help="first-last: the host user ids a root worker leases to its sandboxes, one each. Give no account an "
        "id in it; ignored when the worker is not root.",
    ),
    Setting(
        "uid_lease_dir",
        str,
        label="User id lease directory (root workers)",
        help=("Where a root worker records which sandbox holds which id; one directory for every worker of the host."),
        default_text="<tmp>/airflow-sandbox-uids",
    ),
    Setting(
        "cgroup_parent",
        str,
        DEFAULT_CGROUP_PARENT,
        label="cgroup parent",
        help="Where the sandboxes' cgroups go: a relative path lies under the worker's own cgroup, an absolute "
        "one is a path from the hierarchy's root (a delegated cgroup on cgroup v2).",
    ),
    *EGRESS_SETTINGS,
)
UI_BEHAVIOUR = {"hidden-fields": ["host", "port", "schema", "login", "password"]}

FORM = ConnectionForm(
    conn_type="sandbox_local",
    hook_name="Sandbox (bubblewrap on the worker)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
)
