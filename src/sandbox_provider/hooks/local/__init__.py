"""The local backend: bubblewrap on the worker. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.local.hook import LocalSandboxBackend, LocalSandboxHook, SweepReport

__all__ = ["LocalSandboxBackend", "LocalSandboxHook", "SweepReport"]
