"""One hook per backend, and the lookup from a connection to its hook."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox_provider.sandbox.hook import SandboxHook

__all__ = ["CONNECTION_TYPES", "get_sandbox_hook"]

#: Connection type -> (module, hook class, name of the hook's connection-id argument).
CONNECTION_TYPES: dict[str, tuple[str, str, str]] = {
    "sandbox_local": ("sandbox_provider.hooks.local", "LocalSandboxHook", "sandbox_conn_id"),
    "sandbox_docker": ("sandbox_provider.hooks.docker", "DockerSandboxHook", "sandbox_conn_id"),
    "modal": ("sandbox_provider.hooks.modal", "ModalSandboxHook", "modal_conn_id"),
}


def get_sandbox_hook(backend: SandboxHook | str | None) -> SandboxHook:
    """
    Return the hook for ``backend``: a hook instance as is, a connection id resolved to its hook, or,
    for None, the embedded bubblewrap backend (:class:`~sandbox_provider.hooks.local.LocalSandboxHook`).

    Resolving a connection id reads the connection, so call this at run time, never at parse time.

    :raises ValueError: for a connection whose type no sandbox backend handles, or a value of the
        wrong type.
    """
    from sandbox_provider.sandbox.hook import SandboxHook

    if backend is None:
        from sandbox_provider.hooks.local import LocalSandboxHook

        return LocalSandboxHook()
    if isinstance(backend, SandboxHook):
        return backend
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(
            f"backend must be a sandbox hook, a connection id, or None for the local backend; got {backend!r}."
        )
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(backend)
    entry = CONNECTION_TYPES.get(conn.conn_type or "")
    if entry is None:
        known = ", ".join(sorted(CONNECTION_TYPES))
        raise ValueError(
            f"Connection {backend!r} has type {conn.conn_type!r}, which no sandbox backend handles. "
            f"Use a connection of one of these types: {known}."
        )
    module, class_name, conn_arg = entry
    hook_class = getattr(importlib.import_module(module), class_name)
    return hook_class(**{conn_arg: backend})
