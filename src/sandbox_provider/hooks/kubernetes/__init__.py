"""
The Kubernetes backend: one hardened Pod per sandbox on a cluster. The hook is in ``hook.py``, plain
functions in ``driver.py``, exec streams in ``exec.py``, commands and file operations in ``commands.py``.
"""

from sandbox_provider.hooks.kubernetes.hook import KubernetesSandboxBackend, KubernetesSandboxHook

__all__ = ["KubernetesSandboxBackend", "KubernetesSandboxHook"]
