"""The ``islo`` backend's connection form."""

from __future__ import annotations

from sandbox_provider.hooks.forms._hosted import request_timeout, service_fields
from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

DEFAULT_SANDBOX_TIMEOUT = 3600
DEFAULT_PAUSE_AFTER_IDLE = 600
AUTO_RESUME = ("on_activity", "never")

SETTINGS = SettingsTable(
    Setting(
        "image",
        str,
        label="Image",
        help="Image a sandbox boots; it needs sh and coreutils (timeout, tail, mktemp).",
        default_text="Islo's",
    ),
    Setting("vcpus", int, label="vCPUs", help="Virtual CPUs per sandbox.", default_text="Islo's", minimum=1),
    Setting(
        "memory_mb",
        int,
        label="Memory (MiB)",
        help="Memory per sandbox in MiB.",
        default_text="Islo's",
        unit="MiB",
        minimum=128,
    ),
    Setting(
        "disk_gb", int, label="Disk (GB)", help="Disk per sandbox in GB.", default_text="Islo's", unit="GB", minimum=1
    ),
    Setting(
        "sandbox_timeout",
        int,
        DEFAULT_SANDBOX_TIMEOUT,
        label="Sandbox lifetime (seconds)",
        help="Seconds from creation (not from last use) after which Islo deletes the sandbox (its delete_after).",
        unit="seconds",
        minimum=60,
    ),
    Setting(
        "pause_after_idle",
        int,
        DEFAULT_PAUSE_AFTER_IDLE,
        label="Pause after idle (seconds)",
        help="Seconds without activity after which Islo pauses the sandbox.",
        unit="seconds",
        minimum=60,
    ),
    Setting(
        "auto_resume",
        str,
        "on_activity",
        label="Resume a paused sandbox",
        help="on_activity: the next command or file operation resumes it; never: a paused sandbox cannot be used.",
        choices=AUTO_RESUME,
    ),
    Setting(
        "base_url",
        str,
        label="Control API URL",
        help="Islo's control-plane URL, where the API key is exchanged.",
        default_text="ISLO_BASE_URL, else Islo's",
    ),
    request_timeout("Seconds one API request may take."),
)
UI_BEHAVIOUR = service_fields(host_label="Compute API URL", host_placeholder="https://ca.compute.islo.dev")

FORM = ConnectionForm(
    conn_type="sandbox_islo",
    hook_name="Sandbox (Islo)",
    settings=SETTINGS,
    ui_behaviour=UI_BEHAVIOUR,
    conn_name_attr="islo_conn_id",
)
