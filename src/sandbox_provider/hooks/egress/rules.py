"""
What the egress gateway lets through: the policy of one sandbox and the decision on one connection
attempt. Plain values and functions, no proxy and no network of their own; the gateway's plugin
asks :func:`decide` for every request it gets.

The rules, in the order they apply:

1. The destination is an IP address (``CONNECT 203.0.113.7:22``): allowed, on any port, only when
   an ``allow_egress_to_cidrs`` range holds it. No other address is ever connected to.
2. The destination is a name: allowed only when ``allow_egress_to`` lists it (exactly, or as a
   subdomain of a ``*.`` entry) and the port is one of ``ports`` (443 unless the hook sets others).
   Nothing is resolved for a name that is refused here, so an unlisted name costs no DNS lookup.
3. A listed name is resolved by the gateway, never inside the sandbox: through ``pins`` (names the
   operator maps to addresses, trusted as given), else the worker's resolver. Of the addresses it
   gets, only public ones (``is_global``, not multicast) or those in a listed range are used, so a
   listed name whose DNS points at loopback, link-local (cloud metadata), private or reserved
   addresses is refused unless a range lists them.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox_provider.sandbox.spec import hostname_allowlist

__all__ = ["DEFAULT_PORTS", "Decision", "EgressPolicy", "address_ranges", "check_ports", "decide", "host_pins"]

#: The ports a listed hostname is reached on unless the hook names others.
DEFAULT_PORTS: tuple[int, ...] = (443,)

#: Resolves a name to its addresses: ``resolver(host, port) -> [address, ...]``.
Resolver = Callable[[str, int], Sequence[str]]

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def address_ranges(entries: Sequence[str]) -> list[str]:
    """
    The ranges of an ``allow_egress_to_cidrs`` list in canonical form (``"10.1.0.0/16"``), each once.

    :raises ValueError: naming the first entry that is not an address or a range without host bits.
    """
    ranges: list[str] = []
    for entry in entries:
        text = entry.strip()
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError:
            try:
                hint = f" such as {str(ipaddress.ip_network(text, strict=False))!r}"
            except ValueError:
                hint = " such as '203.0.113.0/24' or '198.51.100.7'"
            raise ValueError(
                f"allow_egress_to_cidrs entry {entry!r} is not an address range. Give a network address with its "
                f"prefix length and no host bits{hint}; put hostnames in allow_egress_to."
            ) from None
        if str(net) not in ranges:
            ranges.append(str(net))
    return ranges


def check_ports(ports: Any) -> tuple[int, ...]:
    """
    ``ports`` as a tuple of TCP port numbers (1 to 65535), each once.

    :raises ValueError: for anything else, or for no port at all.
    """
    if isinstance(ports, (str, bytes, int)) or ports is None:
        raise ValueError(f"egress_ports must be a list of port numbers such as [443, 8443], got {ports!r}.")
    checked: list[int] = []
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"egress_ports entry {port!r} is not a TCP port number (1 to 65535).")
        if port not in checked:
            checked.append(port)
    if not checked:
        raise ValueError("egress_ports must name at least one port (443 is the default).")
    return tuple(checked)


def host_pins(pins: Mapping[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """
    ``pins`` (hostname -> an address or a list of them) with canonical names and checked addresses.

    :raises ValueError: for a name that is not a hostname or an address that is not one.
    """
    if not pins:
        return {}
    if not isinstance(pins, Mapping):
        raise ValueError(f"egress_pins must map hostnames to addresses, got {type(pins).__name__}.")
    checked: dict[str, tuple[str, ...]] = {}
    for name, value in pins.items():
        (host,) = hostname_allowlist([name])
        addresses = [value] if isinstance(value, str) else list(value)
        try:
            checked[host] = tuple(str(ipaddress.ip_address(a)) for a in addresses)
        except (ValueError, TypeError):
            raise ValueError(f"egress_pins[{name!r}] must be an IP address or a list of them, got {value!r}.") from None
        if not checked[host]:
            raise ValueError(f"egress_pins[{name!r}] names no address.")
    return checked


@dataclass(frozen=True)
class EgressPolicy:
    """
    What one sandbox's gateway lets through.

    :param handle: the sandbox the gateway serves; every logged attempt names it.
    :param hosts: canonical hostnames (``hostname_allowlist``), ``*.`` entries for any subdomain.
    :param cidrs: canonical address ranges (``address_ranges``), reached on any port.
    :param ports: the ports listed hostnames are reached on.
    :param pins: hostname -> addresses the gateway uses instead of resolving the name (trusted).
    """

    handle: str
    hosts: tuple[str, ...] = ()
    cidrs: tuple[str, ...] = ()
    ports: tuple[int, ...] = DEFAULT_PORTS
    pins: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The policy as plain JSON values, for the gateway's configuration file."""
        return {
            "handle": self.handle,
            "hosts": list(self.hosts),
            "cidrs": list(self.cidrs),
            "ports": list(self.ports),
            "pins": {name: list(addresses) for name, addresses in self.pins.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EgressPolicy:
        """The policy :meth:`to_json` wrote."""
        return cls(
            handle=str(data["handle"]),
            hosts=tuple(data["hosts"]),
            cidrs=tuple(data["cidrs"]),
            ports=tuple(int(p) for p in data["ports"]),
            pins={name: tuple(addresses) for name, addresses in data["pins"].items()},
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


@dataclass(frozen=True)
class Decision:
    """
    The gateway's answer to one connection attempt.

    :param allowed: whether it connects.
    :param address: the address it connects to (allowed only).
    :param reason: why, in words for the log and the refused client.
    """

    allowed: bool
    address: str | None
    reason: str


def system_resolver(host: str, port: int) -> list[str]:
    """The worker's resolver: every address ``host`` has for TCP ``port``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _address(host: str) -> _Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _in_ranges(address: _Address, ranges: Sequence[_Network]) -> bool:
    return any(address.version == net.version and address in net for net in ranges)


def name_listed(host: str, hosts: Sequence[str]) -> bool:
    """Whether ``host`` (canonical) is one of ``hosts`` or a subdomain of a ``*.`` entry."""
    for entry in hosts:
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and len(host) > len(entry) - 1:
                return True
        elif host == entry:
            return True
    return False


def decide(policy: EgressPolicy, host: str | None, port: int | None, resolver: Resolver = system_resolver) -> Decision:
    """
    Whether a connection to ``host`` on ``port`` may go ahead under ``policy``, and to which address.

    ``resolver`` is asked only for a listed name that has no pin.
    """
    if not host or not port:
        return Decision(False, None, "not a proxy request: send CONNECT host:port, or an absolute http:// URL")
    host = host.strip().lower().rstrip(".")
    ranges = [ipaddress.ip_network(c) for c in policy.cidrs]
    literal = _address(host)
    if literal is not None:
        if _in_ranges(literal, ranges):
            return Decision(True, str(literal), "address in allow_egress_to_cidrs")
        return Decision(False, None, f"address {literal} is in no range of allow_egress_to_cidrs")
    if not name_listed(host, policy.hosts):
        return Decision(False, None, f"host {host!r} is not in allow_egress_to")
    if port not in policy.ports:
        allowed = ", ".join(str(p) for p in policy.ports)
        return Decision(False, None, f"port {port} is not an allowed port for listed hosts ({allowed})")
    if host in policy.pins:
        return Decision(True, policy.pins[host][0], "listed host, pinned address")
    try:
        addresses = list(resolver(host, port))
    except OSError as err:
        return Decision(False, None, f"host {host!r} does not resolve: {err}")
    for text in addresses:
        address = _address(text)
        if address is None:
            continue
        if (address.is_global and not address.is_multicast) or _in_ranges(address, ranges):
            return Decision(True, str(address), "listed host")
    shown = ", ".join(addresses) or "nothing"
    return Decision(
        False,
        None,
        f"host {host!r} resolves to {shown}: loopback, link-local, private or reserved addresses are refused "
        "unless allow_egress_to_cidrs lists them",
    )
