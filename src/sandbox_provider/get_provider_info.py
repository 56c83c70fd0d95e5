"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

_LIFETIME = {
    "label": "Sandbox lifetime (seconds)",
    "schema": {"type": ["integer", "null"], "minimum": 1},
    "description": "Seconds a sandbox may live before it is removed. Default 3600.",
}


def get_provider_info() -> dict[str, Any]:
    """Return the provider description: connection types (with form fields), the task decorator."""
    from sandbox_provider import __version__

    return {
        "package-name": "airflow-provider-sandbox",
        "name": "Sandbox",
        "description": "Isolated sandboxes for Dags: run code you do not fully trust on bubblewrap, Docker or Modal.",
        "versions": [__version__],
        "connection-types": [
            {
                "connection-type": "sandbox_local",
                "hook-class-name": "sandbox_provider.hooks.local.LocalSandboxHook",
                "hook-name": "Sandbox (bubblewrap on the worker)",
                "conn-fields": {
                    "state_root": {
                        "label": "State directory",
                        "schema": {"type": ["string", "null"]},
                        "description": "Where sandboxes live on the worker. Default: <tmp>/airflow-sandbox-<uid>.",
                    },
                    "image": {
                        "label": "Root filesystem directory",
                        "schema": {"type": ["string", "null"]},
                        "description": "A directory used as the sandbox's read-only root instead of the host's "
                        "system directories.",
                    },
                    "sandbox_timeout": _LIFETIME,
                    "cpu_seconds": {
                        "label": "CPU seconds per process",
                        "schema": {"type": ["integer", "null"], "minimum": 1},
                    },
                    "memory_bytes": {
                        "label": "Address space per process (bytes)",
                        "schema": {"type": ["integer", "null"], "minimum": 1},
                    },
                    "max_processes": {
                        "label": "Process limit",
                        "schema": {"type": ["integer", "null"], "minimum": 1},
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["host", "port", "schema", "login", "password"],
                },
            },
            {
                "connection-type": "sandbox_docker",
                "hook-class-name": "sandbox_provider.hooks.docker.DockerSandboxHook",
                "hook-name": "Sandbox (Docker Engine)",
                "conn-fields": {
                    "image": {
                        "label": "Default image",
                        "schema": {"type": ["string", "null"]},
                    },
                    "network": {
                        "label": "Network for block_network=False",
                        "schema": {"type": ["string", "null"]},
                        "description": "Docker network joined when the spec opens the network. Default: bridge.",
                    },
                    "cpus": {"label": "CPUs", "schema": {"type": ["number", "null"], "exclusiveMinimum": 0}},
                    "memory_bytes": {"label": "Memory limit (bytes)", "schema": {"type": ["integer", "null"]}},
                    "pids_limit": {"label": "Process limit", "schema": {"type": ["integer", "null"]}},
                    "sandbox_timeout": _LIFETIME,
                    "tls_ca_cert": {"label": "TLS CA certificate (path)", "schema": {"type": ["string", "null"]}},
                    "tls_client_cert": {
                        "label": "TLS client certificate (path)",
                        "schema": {"type": ["string", "null"]},
                    },
                    "tls_client_key": {"label": "TLS client key (path)", "schema": {"type": ["string", "null"]}},
                    "tls_verify": {"label": "Verify TLS", "schema": {"type": ["boolean", "null"]}},
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["port", "schema"],
                    "relabeling": {
                        "host": "Docker daemon address",
                        "login": "Registry user",
                        "password": "Registry password",
                    },
                    "placeholders": {"host": "unix:///var/run/docker.sock"},
                },
            },
        ],
        "task-decorators": [
            {"name": "sandbox", "class-name": "sandbox_provider.decorators.sandbox.sandbox_task"},
        ],
    }
