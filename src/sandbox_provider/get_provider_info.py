"""
Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point.

Airflow calls this while it starts, so it imports no hook: the connection types come from each
backend's form module (``hooks/forms/<backend>.py``), which imports nothing of Airflow.
"""

from __future__ import annotations

import importlib
from typing import Any


def connection_forms() -> list[tuple[str, Any]]:
    """``(hook class path, ConnectionForm)`` for every backend with a connection type of its own."""
    from sandbox_provider.hooks import HOOK_CLASSES

    found = []
    for path in HOOK_CLASSES:
        module, _, name = path.partition(":")
        form_module = module.replace(".hooks.", ".hooks.forms.", 1)
        try:
            forms = importlib.import_module(form_module)
        except ModuleNotFoundError as err:
            if err.name != form_module:
                raise
            continue  # a backend on another provider's connection type (Modal's "modal")
        found.append((f"{module}.{name}", forms.FORM))
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
                "conn-fields": form.settings.form_fields(),
                "ui-field-behaviour": dict(form.ui_behaviour),
            }
            for path, form in connection_forms()
        ],
        "task-decorators": [
            {"name": "sandbox", "class-name": "sandbox_provider.decorators.sandbox.sandbox_task"},
        ],
    }
