"""
One folder per backend (``hooks/<backend>/``: ``hook.py`` the hook, ``driver.py`` plain functions over
the vendor's SDK, ``guest/`` the programs only it runs), what several backends share (``egress/``, the
gateway of local and Docker; ``hosted/``), the connection forms (``forms/``, free of Airflow), and the
lookup from a connection to its hook.

:data:`BACKENDS` is the one list of backends: it drives the connection types Airflow registers
(with their form fields, from each hook's settings table) and :func:`get_sandbox_hook`; the
``*SandboxBackend`` names of :mod:`sandbox_provider.sandbox` are checked against it. Hook modules
import their vendor's SDK only when a sandbox is used, so loading a hook class is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox_provider.sandbox.hook import SandboxHook

__all__ = ["BACKENDS", "HOOK_CLASSES", "connection_types", "get_sandbox_hook", "hook_class", "hook_classes"]

#: Every backend: its hook as ``"module:ClassName"``, and the module of its connection form
#: (``hooks/forms/<backend>.py``, which imports nothing of Airflow), or None for a backend on another
#: provider's connection type (Modal's ``modal``, the cncf provider's ``kubernetes``).
BACKENDS: dict[str, str | None] = {
    "sandbox_provider.hooks.local:LocalSandboxHook": "sandbox_provider.hooks.forms.local",
    "sandbox_provider.hooks.docker:DockerSandboxHook": "sandbox_provider.hooks.forms.docker",
    "sandbox_provider.hooks.modal:ModalSandboxHook": None,
    "sandbox_provider.hooks.islo:IsloSandboxHook": "sandbox_provider.hooks.forms.islo",
    "sandbox_provider.hooks.boat:BoatSandboxHook": "sandbox_provider.hooks.forms.boat",
    "sandbox_provider.hooks.opensandbox:OpenSandboxHook": "sandbox_provider.hooks.forms.opensandbox",
    "sandbox_provider.hooks.openshell:OpenShellSandboxHook": "sandbox_provider.hooks.forms.openshell",
    "sandbox_provider.hooks.sbx:SbxSandboxHook": "sandbox_provider.hooks.forms.sbx",
    "sandbox_provider.hooks.kubernetes:KubernetesSandboxHook": None,
}
#: Every backend's hook, as ``"module:ClassName"``.
HOOK_CLASSES: tuple[str, ...] = tuple(BACKENDS)


def hook_class(path: str) -> type[SandboxHook]:
    """Import and return the hook class named ``"module:ClassName"``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def hook_classes() -> list[type[SandboxHook]]:
    """Every backend's hook class, in :data:`HOOK_CLASSES` order."""
    return [hook_class(path) for path in HOOK_CLASSES]


def connection_types() -> dict[str, type[SandboxHook]]:
    """Connection type -> the hook class that handles it, for every backend."""
    return {cls.conn_type: cls for cls in hook_classes()}


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
    types = connection_types()
    cls = types.get(conn.conn_type or "")
    if cls is None:
        known = ", ".join(sorted(types))
        raise ValueError(
            f"Connection {backend!r} has type {conn.conn_type!r}, which no sandbox backend handles. "
            f"Use a connection of one of these types: {known}."
        )
    return cls(**{cls.conn_name_attr: backend})
