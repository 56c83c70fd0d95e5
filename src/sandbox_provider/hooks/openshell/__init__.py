"""The openshell backend: an NVIDIA OpenShell gateway. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.openshell.hook import OpenShellSandboxBackend, OpenShellSandboxHook, OpenShellSandboxInfo

__all__ = ["OpenShellSandboxBackend", "OpenShellSandboxHook", "OpenShellSandboxInfo"]
