"""
The sandbox contract and the session engine.

Backends are importable from here under their hook name and under the ``*SandboxBackend`` name
the public guide uses (``ModalSandboxBackend``). Everything that imports Airflow or a backend loads
on first use, so this package, its value types and its settings import without Airflow being
initialised (Airflow reads the provider's connection forms while it starts).
"""

from __future__ import annotations

import importlib
from typing import Any

from sandbox_provider.hooks import HOOK_CLASSES
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    AttachedSandbox,
    SandboxExecResult,
    SandboxSpec,
    dag_run_owner,
    is_sandbox_handle,
)

_LAZY = {
    "SandboxHook": "sandbox_provider.sandbox.hook",
    "SandboxBackend": "sandbox_provider.sandbox.hook",
    "SandboxSession": "sandbox_provider.sandbox.session",
    "task_holder": "sandbox_provider.sandbox.session",
}
# The *SandboxBackend names of the guide, from the one list of backends.
_LAZY.update(
    {
        alias: path.partition(":")[0]
        for path in HOOK_CLASSES
        for alias in (path.partition(":")[2], path.partition(":")[2].replace("Hook", "Backend"))
    }
)

__all__ = [
    "AttachedSandbox",
    "SandboxError",
    "SandboxExecResult",
    "SandboxFileTooLargeError",
    "SandboxSpec",
    "SandboxTerminalError",
    "dag_run_owner",
    "is_sandbox_handle",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
