"""The modal backend: Modal's hosted platform. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.modal.hook import SANDBOX_MARKER_TAG, ModalSandboxBackend, ModalSandboxHook

__all__ = ["SANDBOX_MARKER_TAG", "ModalSandboxBackend", "ModalSandboxHook"]
