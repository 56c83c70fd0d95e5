"""The docker backend: containers on a Docker Engine. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.docker.hook import DockerSandboxBackend, DockerSandboxHook, DockerSandboxInfo

__all__ = ["DockerSandboxBackend", "DockerSandboxHook", "DockerSandboxInfo"]
