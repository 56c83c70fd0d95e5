"""What a backend with an egress gateway (local, Docker) shares: the refusal and the description."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

from sandbox_provider.hooks import egress
from sandbox_provider.sandbox.network import describe_reach
from sandbox_provider.sandbox.spec import SandboxSpec

__all__ = ["GatewayEgress"]


class GatewayEgress:
    """
    Mixin for a ``SandboxHook`` that enforces ``allow_egress_to`` and ``allow_egress_to_cidrs``
    through :mod:`sandbox_provider.hooks.egress`. The hook sets ``egress_ports`` and
    ``egress_pins`` (checked with :func:`~sandbox_provider.hooks.egress.check_ports` and
    :func:`~sandbox_provider.hooks.egress.host_pins`) and ``egress_max_connections``
    (:func:`~sandbox_provider.hooks.egress.check_max_connections`) in its constructor.
    """

    #: Whether the forwarder enters the sandbox's namespace from the worker (nsenter, as root).
    egress_from_outside: ClassVar[bool] = False
    egress_ports: tuple[int, ...] = egress.DEFAULT_PORTS
    egress_pins: Mapping[str, tuple[str, ...]] = {}
    egress_max_connections: int = egress.MAX_CONNECTIONS

    def _refusal(self, spec: SandboxSpec) -> str | None:
        name = str(getattr(self, "display_name", "sandbox"))
        outside = self.egress_from_outside
        reason = egress.refusal(name, spec, ports=self.egress_ports, pins=self.egress_pins, nsenter=outside)
        if reason is None and spec.has_allowlist and outside and os.geteuid() != 0:
            reason = (
                f"The {name} backend enforces allow_egress_to and allow_egress_to_cidrs through an egress gateway "
                "whose forwarder enters the sandbox's network namespace from the worker, which needs a root worker "
                "on the same host. Run the worker as root there, or drop the allow lists."
            )
        return reason

    def describe_network(self, spec: SandboxSpec) -> str | None:
        if not spec.has_allowlist:
            return None
        network = self.capabilities.network  # type: ignore[attr-defined]
        return describe_reach(egress.reach(network, self.egress_ports), spec)
