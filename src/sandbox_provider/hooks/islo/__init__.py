"""The islo backend: Islo's hosted microVMs. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.islo.hook import IsloSandboxBackend, IsloSandboxHook

__all__ = ["IsloSandboxBackend", "IsloSandboxHook"]
