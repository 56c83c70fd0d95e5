"""The boat backend: Boat's hosted platform. The hook is in ``hook.py``, plain functions in ``driver.py``."""

from sandbox_provider.hooks.boat.hook import BoatSandboxBackend, BoatSandboxHook

__all__ = ["BoatSandboxBackend", "BoatSandboxHook"]
