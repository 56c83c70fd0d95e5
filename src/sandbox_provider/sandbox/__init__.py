"""
The sandbox contract and the session engine.

Backends are importable from here under their hook name and under the ``*SandboxBackend`` name
the public guide uses (``ModalSandboxBackend``); they load lazily, so this package imports without
any backend's optional dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.hook import SandboxHook
from sandbox_provider.sandbox.session import SandboxSession, task_holder
from sandbox_provider.sandbox.spec import (
    AttachedSandbox,
    SandboxExecResult,
    SandboxSpec,
    dag_run_owner,
    is_sandbox_handle,
)

#: The contract's base class under the name the public guide uses.
SandboxBackend = SandboxHook

_LAZY = {
    "LocalSandboxHook": "sandbox_provider.hooks.local",
    "LocalSandboxBackend": "sandbox_provider.hooks.local",
    "DockerSandboxHook": "sandbox_provider.hooks.docker",
    "DockerSandboxBackend": "sandbox_provider.hooks.docker",
    "ModalSandboxHook": "sandbox_provider.hooks.modal",
    "ModalSandboxBackend": "sandbox_provider.hooks.modal",
}

__all__ = [
    "AttachedSandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxExecResult",
    "SandboxFileTooLargeError",
    "SandboxHook",
    "SandboxSession",
    "SandboxSpec",
    "SandboxTerminalError",
    "dag_run_owner",
    "is_sandbox_handle",
    "task_holder",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
