"""
Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point.

Airflow calls this while it starts, so it imports no hook: the connection types come from each
backend's form module (``hooks/forms/<backend>.py``), which imports nothing of Airflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

#: Airflow 3.3 (3.3.0 to 3.3.2 at least) refuses the UI's Test button for a stored connection with no
#: port: the UI posts ``port: 0`` for it, and the API server takes 0 for another endpoint than the
#: stored empty port ("The host or port to test differs from the stored connection"). A port of 0 is
#: stored as 0 and then matches; no sandbox backend uses the port, and Airflow leaves 0 out of the
#: connection's URI. So from Airflow 3.3 on, the form shows the port with this label.
PORT_FOR_TEST_BUTTON = "Port: not used; enter 0 so the Test button works (Airflow 3.3)"


def port_needed_by_test_button() -> bool:
    """Whether the installed Airflow refuses the UI's Test button for a connection whose port is empty."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("apache-airflow-core")) >= Version("3.3.0")
    except PackageNotFoundError:
        return False


def ui_field_behaviour(behaviour: Mapping[str, Any]) -> dict[str, Any]:
    """
    A backend's standard form fields as Airflow gets them: the backend's own, and on an Airflow whose
    Test button needs a port (see :data:`PORT_FOR_TEST_BUTTON`), a port the backend hides shown,
    labelled and with the placeholder ``0``.
    """
    result = dict(behaviour)
    # A backend that reads the port (a gateway's, a server's) keeps its own label for it.
    if port_needed_by_test_button() and "port" in result.get("hidden-fields", []):
        result["hidden-fields"] = [name for name in result.get("hidden-fields", []) if name != "port"]
        result["relabeling"] = {**result.get("relabeling", {}), "port": PORT_FOR_TEST_BUTTON}
        result["placeholders"] = {**result.get("placeholders", {}), "port": "0"}
    return result


def connection_forms() -> list[tuple[str, Any]]:
    """``(hook class path, ConnectionForm)`` for every backend with a connection type of its own."""
    from sandbox_provider.hooks import BACKENDS

    found = []
    for path, form_module in BACKENDS.items():
        if form_module is not None:
            module, _, name = path.partition(":")
            found.append((f"{module}.{name}", importlib.import_module(form_module).FORM))
    return found


def get_provider_info() -> dict[str, Any]:
    """Return the provider description: connection types (with form fields), the task decorator."""
    from sandbox_provider import __version__

    return {
        "package-name": "airflow-provider-sandbox",
        "name": "Sandbox",
        "description": "Isolated sandboxes for Dags: run code you do not fully trust on bubblewrap, Docker, Modal "
        "and more.",
        "versions": [__version__],
        "connection-types": [
            {
                "connection-type": form.conn_type,
                "hook-class-name": path,
                "hook-name": form.hook_name,
                "conn-fields": form.form_fields(),
                "ui-field-behaviour": ui_field_behaviour(form.ui_behaviour),
            }
            for path, form in connection_forms()
        ],
        "triggers": [
            {"integration-name": "Sandbox", "python-modules": ["sandbox_provider.triggers.sandbox"]},
        ],
        # Airflow 3.2+ imports this function for every command line and adds what it returns to the
        # ``airflow`` CLI; it imports no backend (see sandbox_provider.cli).
        "cli": ["sandbox_provider.cli.get_cli_commands"],
        "task-decorators": [
            {"name": "sandbox", "class-name": "sandbox_provider.decorators.sandbox.sandbox_task"},
        ],
        "config": {
            "sandbox": {
                "description": "Settings of the sandbox provider that apply to every task of this deployment.",
                "options": {
                    "file_input_dirs": {
                        "description": "Directories file:// inputs may be staged from, as absolute paths separated "
                        "by commas. An input outside them, once every symlink on its way is followed, is refused "
                        "before anything is provisioned. Empty: any file the worker's user can read.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "/data/incoming,/srv/reference",
                        "default": "",
                    },
                    "default_deferrable": {
                        "description": "The default of deferrable= for SandboxOperator and @task.sandbox: whether a "
                        "task starts its command detached in the sandbox and frees its worker slot while the command "
                        "runs, waiting in the triggerer instead. Needs a triggerer, and a backend whose sandboxes it "
                        "can check on (not the local one).",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    "deployment": {
                        "description": "A name for this Airflow deployment, stamped on every Docker sandbox it "
                        "creates (the airflow_deployment label). Docker's sweeps (at every create, remove_expired, "
                        "airflow sandboxes list/sweep) consider only the sandboxes with the same name, so deployments "
                        "sharing one Docker Engine never remove each other's sandboxes. Up to 63 letters, digits, "
                        "'-', '_' and '.', beginning and ending with a letter or digit. Empty: the sandboxes without "
                        "a deployment name. Other backends isolate deployments by their own namespace, state root or "
                        "server.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "prod-eu",
                        "default": "",
                    },
                },
            },
        },
    }
