"""
The sandbox contract: what a backend implements and every consumer relies on.

Backends are importable from here under their hook name and under the ``*SandboxBackend`` name
the public guide uses (``ModalSandboxBackend``), and so are the engine's ``SandboxSession`` and
``task_holder``. Everything that imports Airflow, the engine or a backend loads on first use, from
the static map :data:`LAZY` (this package imports nothing above it), so this package, its value
types and its settings import without Airflow being initialised (Airflow reads the provider's
connection forms while it starts).
"""

from __future__ import annotations

import importlib
from typing import Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    AttachedSandbox,
    SandboxExecResult,
    SandboxSpec,
    dag_run_owner,
    is_sandbox_handle,
)

#: Name -> ``"module:Name"`` of what this package serves on first use. Every backend of
#: :data:`sandbox_provider.hooks.BACKENDS` is here under its hook class name and the guide's
#: ``*SandboxBackend`` name (a test holds the two lists together).
LAZY: dict[str, str] = {
    "SandboxHook": "sandbox_provider.sandbox.hook:SandboxHook",
    "SandboxBackend": "sandbox_provider.sandbox.hook:SandboxBackend",
    "SandboxSession": "sandbox_provider.engine.session:SandboxSession",
    "task_holder": "sandbox_provider.engine.session:task_holder",
    "LocalSandboxHook": "sandbox_provider.hooks.local:LocalSandboxHook",
    "LocalSandboxBackend": "sandbox_provider.hooks.local:LocalSandboxBackend",
    "DockerSandboxHook": "sandbox_provider.hooks.docker:DockerSandboxHook",
    "DockerSandboxBackend": "sandbox_provider.hooks.docker:DockerSandboxBackend",
    "ModalSandboxHook": "sandbox_provider.hooks.modal:ModalSandboxHook",
    "ModalSandboxBackend": "sandbox_provider.hooks.modal:ModalSandboxBackend",
    "IsloSandboxHook": "sandbox_provider.hooks.islo:IsloSandboxHook",
    "IsloSandboxBackend": "sandbox_provider.hooks.islo:IsloSandboxBackend",
    "BoatSandboxHook": "sandbox_provider.hooks.boat:BoatSandboxHook",
    "BoatSandboxBackend": "sandbox_provider.hooks.boat:BoatSandboxBackend",
    "OpenSandboxHook": "sandbox_provider.hooks.opensandbox:OpenSandboxHook",
    "OpenSandboxBackend": "sandbox_provider.hooks.opensandbox:OpenSandboxBackend",
    "OpenShellSandboxHook": "sandbox_provider.hooks.openshell:OpenShellSandboxHook",
    "OpenShellSandboxBackend": "sandbox_provider.hooks.openshell:OpenShellSandboxBackend",
    "SbxSandboxHook": "sandbox_provider.hooks.sbx:SbxSandboxHook",
    "SbxSandboxBackend": "sandbox_provider.hooks.sbx:SbxSandboxBackend",
    "KubernetesSandboxHook": "sandbox_provider.hooks.kubernetes:KubernetesSandboxHook",
    "KubernetesSandboxBackend": "sandbox_provider.hooks.kubernetes:KubernetesSandboxBackend",
}

__all__ = [
    "AttachedSandbox",
    "SandboxError",
    "SandboxExecResult",
    "SandboxFileTooLargeError",
    "SandboxSpec",
    "SandboxTerminalError",
    "dag_run_owner",
    "is_sandbox_handle",
    *LAZY,
]


def __getattr__(name: str) -> Any:
    path = LAZY.get(name)
    if path is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
