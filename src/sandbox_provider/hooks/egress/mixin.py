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
    through :mod:`sandbox_provider.hooks.egress`. The hook's settings table has the gateway's settings
    (``hooks/forms/_egress.py``: ``egress_ports``, ``egress_pins``, ``egress_max_connections``), so
    each is a hook argument and a connection extra; the properties below read the resolved value.
    """

    #: Whether the forwarder enters the sandbox's namespace from the worker (nsenter, as root).
    egress_from_outside: ClassVar[bool] = False

    @property
    def egress_ports(self) -> tuple[int, ...]:
        """The ports listed hosts are reached on (the hook argument, else the connection's extra, else ``(443,)``)."""
        return tuple(self._resolved()["egress_ports"])  # type: ignore[attr-defined]

    @property
    def egress_pins(self) -> Mapping[str, tuple[str, ...]]:
        """Hostname -> the addresses the gateway uses for it instead of resolving it; empty by default."""
        return self._resolved()["egress_pins"] or {}  # type: ignore[attr-defined]

    @property
    def egress_max_connections(self) -> int:
        """The most connections one sandbox's gateway holds at once (default 64)."""
        return int(self._resolved()["egress_max_connections"])  # type: ignore[attr-defined]

    def _egress_argument(self, name: str) -> object:
        """A gateway setting as the hook was given it, else its default: what is known without the connection."""
        value = self._args.get(name)  # type: ignore[attr-defined]
        return self.settings[name].default if value is None else value  # type: ignore[attr-defined]

    def _refusal(self, spec: SandboxSpec) -> str | None:
        name = str(getattr(self, "display_name", "sandbox"))
        outside = self.egress_from_outside
        # Nothing is contacted here (it runs at parse time too): the connection's values are checked as they are read.
        ports = self._egress_argument("egress_ports")
        pins = self._egress_argument("egress_pins")
        if spec.has_allowlist:
            # The cap the gateway will hold this sandbox to: a bad one fails here, before provisioning.
            self._egress_argument("egress_max_connections")
        reason = egress.refusal(name, spec, ports=ports, pins=pins, nsenter=outside)  # type: ignore[arg-type]
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
