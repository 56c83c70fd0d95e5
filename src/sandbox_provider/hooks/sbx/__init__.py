"""The sbx backend: Docker Sandboxes microVMs (the sbx CLI). The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.sbx.hook import SbxSandboxBackend, SbxSandboxHook, SbxSandboxInfo

__all__ = ["SbxSandboxBackend", "SbxSandboxHook", "SbxSandboxInfo"]
