"""The opensandbox backend: an OpenSandbox server. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.opensandbox.hook import OpenSandboxBackend, OpenSandboxHook

__all__ = ["OpenSandboxBackend", "OpenSandboxHook"]
