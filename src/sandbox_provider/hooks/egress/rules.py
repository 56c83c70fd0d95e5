"""
What the egress gateway lets through: the policy of one sandbox and the decision on one connection
attempt. Plain values and functions, no proxy and no network of their own; the gateway's plugin
asks :func:`decide` for every request it gets.

The rules, in the order they apply:

1. The destination is an IP address (``CONNECT 203.0.113.7:22``): allowed, on any port, only when
   an ``allow_egress_to_cidrs`` range admits it (below). No other address is ever connected to.
2. The destination is a name: allowed only when ``allow_egress_to`` lists it (exactly, or as a
   subdomain of a ``*.`` entry) and the port is one of ``ports`` (443 unless the hook sets others).
   Nothing is resolved for a name that is refused here, so an unlisted name costs no DNS lookup.
3. A listed name is resolved by the gateway, never inside the sandbox: through ``pins`` (names the
   operator maps to addresses, trusted as given), else the worker's resolver. Of the addresses it
   gets, the first that is public (``is_global``, not multicast, not guarded) or that a listed range
   admits is used, so a listed name whose DNS points at loopback, link-local (cloud metadata),
   private or reserved addresses is refused unless a range admits them.

Which ranges admit an address. An IPv6 address that carries an IPv4 one (IPv4-mapped
``::ffff:a.b.c.d``, IPv4-compatible ``::a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``) is judged by the
IPv4 address it carries, everywhere above; a range written in the mapped or NAT64 form
(``::ffff:127.0.0.0/104``) stands for its IPv4 range. A range admits an address it holds, except a
*guarded* one, which only a range inside the guarded block admits (a range naming it on purpose;
a catch-all such as ``0.0.0.0/0``, ``0.0.0.0/1`` or ``::/0`` never does):

- loopback: ``127.0.0.0/8``, ``::1``;
- link-local, where clouds serve their metadata: ``169.254.0.0/16``, ``fe80::/10``, and the
  metadata addresses outside it: ``fd00:ec2::254`` (AWS over IPv6), ``100.100.100.200`` (Alibaba
  Cloud), each a block of its own;
- unspecified: ``0.0.0.0/8`` (connecting to ``0.0.0.0`` reaches the worker itself), ``::``;
- the worker's own addresses (its interfaces', read when the attempt is made), each a block of its
  own, so only that address listed alone (``/32``, ``/128``) admits it.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox_provider.sandbox.spec import hostname_allowlist

__all__ = [
    "DEFAULT_PORTS",
    "GUARDED",
    "Decision",
    "EgressPolicy",
    "address_ranges",
    "admitted",
    "carried_ipv4",
    "check_ports",
    "decide",
    "guard",
    "host_pins",
    "local_addresses",
    "uncarved_guard",
]

#: The ports a listed hostname is reached on unless the hook names others.
DEFAULT_PORTS: tuple[int, ...] = (443,)

#: Resolves a name to its addresses: ``resolver(host, port) -> [address, ...]``.
Resolver = Callable[[str, int], Sequence[str]]
#: The worker's own addresses: ``local() -> [address, ...]``.
LocalAddresses = Callable[[], Iterable[str]]

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The blocks a range must lie inside to admit their addresses, with what they are.
GUARDED: tuple[tuple[_Network, str], ...] = tuple(
    (ipaddress.ip_network(block), what)
    for block, what in (
        ("127.0.0.0/8", "loopback"),
        ("::1/128", "loopback"),
        ("169.254.0.0/16", "link-local (cloud metadata)"),
        ("fe80::/10", "link-local"),
        ("fd00:ec2::254/128", "a cloud metadata address"),
        ("100.100.100.200/32", "a cloud metadata address"),
        ("0.0.0.0/8", "unspecified (this host)"),
        ("::/128", "unspecified (this host)"),
    )
)
#: The IPv6 prefixes whose last 32 bits are the IPv4 address meant: IPv4-mapped, NAT64.
_EMBEDDING = (ipaddress.IPv6Network("::ffff:0:0/96"), ipaddress.IPv6Network("64:ff9b::/96"))
#: IPv4-compatible addresses (deprecated), which carry an IPv4 address too, except ``::`` and ``::1``.
_COMPATIBLE = ipaddress.IPv6Network("::/96")


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


def carried_ipv4(address: _Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 ``address`` carries (mapped, compatible, NAT64); None for none."""
    if address.version != 6:
        return None
    bits = int(address)
    if any(address in prefix for prefix in _EMBEDDING) or (address in _COMPATIBLE and bits > 1):
        return ipaddress.IPv4Address(bits & 0xFFFFFFFF)
    return None


def _ipv4_view(net: _Network) -> ipaddress.IPv4Network | None:
    """The IPv4 range a range in the mapped or NAT64 form stands for; an IPv4 range itself; else None."""
    if net.version == 4:
        return net  # type: ignore[return-value]
    for prefix in _EMBEDDING:
        if net.prefixlen >= 96 and net.subnet_of(prefix):  # type: ignore[arg-type]
            return ipaddress.IPv4Network((int(net.network_address) & 0xFFFFFFFF, net.prefixlen - 96))
    return None


def local_addresses() -> list[str]:
    """The addresses of this host's network interfaces (in the caller's network namespace)."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return [
        entry.address.split("%")[0]
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in families
    ]


def guard(address: _Address, local: Iterable[str] = ()) -> tuple[_Network, str] | None:
    """
    The guarded block ``address`` is in and what it is, judging an IPv6 address that carries an IPv4
    one by that; ``local`` lists the worker's own addresses. None for an address nothing guards.
    """
    judged = carried_ipv4(address) or address
    for block, what in GUARDED:
        if judged.version == block.version and judged in block:
            return block, what
    # By number: a scope (``fd00::5%lo``) makes an address compare unequal, and the kernel ignores it
    # for any but link-local addresses, so the scoped form reaches the worker's own address all the same.
    plain = _unscoped(judged)
    for text in local:
        own = _address(text)
        if own is not None and _unscoped(carried_ipv4(own) or own) == plain:
            return ipaddress.ip_network(plain), "one of the worker's own addresses"
    return None


def _unscoped(address: _Address) -> _Address:
    """``address`` without a scope (``%lo``)."""
    return type(address)(int(address))


def _guarded_forms() -> list[tuple[_Network, _Network, str]]:
    """Each guarded block as written, then each IPv4 one in its mapped and NAT64 forms: (form, block, what)."""
    forms: list[tuple[_Network, _Network, str]] = [(block, block, what) for block, what in GUARDED]
    for block, what in GUARDED:
        if block.version == 4:
            for prefix in _EMBEDDING:
                bits = int(prefix.network_address) | int(block.network_address)
                forms.append((ipaddress.IPv6Network((bits, block.prefixlen + 96)), block, what))
    return forms


def uncarved_guard(net: _Network) -> tuple[_Network, str] | None:
    """
    The first guarded block (and what it is) that ``net`` holds part of without lying inside it, as
    a catch-all such as ``0.0.0.0/0`` or ``::/0`` does; None when there is none. For a backend whose
    enforcement cannot leave those blocks out of a range (the worker's own addresses are not known
    there, so only the fixed blocks count). An IPv4 block counts in its mapped and NAT64 forms too.
    """
    for form, block, what in _guarded_forms():
        if form.version == net.version and net.overlaps(form) and not net.subnet_of(form):  # type: ignore[arg-type]
            return block, what
    return None


def _holds(net: _Network, address: _Address) -> bool:
    """Whether ``net`` holds ``address``, either as written or by the IPv4 address it carries."""
    if net.version == address.version and address in net:
        return True
    judged, view = carried_ipv4(address) or address, _ipv4_view(net)
    return judged.version == 4 and view is not None and judged in view


def _inside(net: _Network, block: _Network) -> bool:
    """Whether ``net`` lies inside ``block`` (a range in the mapped or NAT64 form by its IPv4 range)."""
    if block.version == 4:
        view = _ipv4_view(net)
        return view is not None and view.subnet_of(block)  # type: ignore[arg-type]
    return net.version == 6 and net.subnet_of(block)  # type: ignore[arg-type]


def admitted(address: _Address, ranges: Sequence[_Network], local: Iterable[str] = ()) -> bool:
    """
    Whether a range of ``ranges`` admits ``address``: it holds it, and lies inside the block when
    ``address`` is guarded (see the module's docstring); ``local`` lists the worker's own addresses.
    """
    guarded = guard(address, local)
    return any(_holds(net, address) and (guarded is None or _inside(net, guarded[0])) for net in ranges)


def _public(address: _Address, local: Iterable[str]) -> bool:
    """Whether ``address`` is public (judged by the IPv4 address it carries, if any) and not guarded."""
    judged = carried_ipv4(address) or address
    return judged.is_global and not judged.is_multicast and guard(address, local) is None


def name_listed(host: str, hosts: Sequence[str]) -> bool:
    """Whether ``host`` (canonical) is one of ``hosts`` or a subdomain of a ``*.`` entry."""
    for entry in hosts:
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and len(host) > len(entry) - 1:
                return True
        elif host == entry:
            return True
    return False


def decide(
    policy: EgressPolicy,
    host: str | None,
    port: int | None,
    resolver: Resolver = system_resolver,
    local: LocalAddresses = local_addresses,
) -> Decision:
    """
    Whether a connection to ``host`` on ``port`` may go ahead under ``policy``, and to which address.

    ``resolver`` is asked only for a listed name that has no pin; ``local`` (the worker's own
    addresses) only when an address is judged.
    """
    if not host or not port:
        return Decision(False, None, "not a proxy request: send CONNECT host:port, or an absolute http:// URL")
    host = host.strip().lower().rstrip(".")
    ranges = [ipaddress.ip_network(c) for c in policy.cidrs]
    literal = _address(host)
    if literal is not None:
        return _decide_address(literal, ranges, list(local()))
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
    own = list(local())
    for text in addresses:
        address = _address(text)
        if address is not None and (_public(address, own) or admitted(address, ranges, own)):
            return Decision(True, str(address), "listed host")
    shown = ", ".join(addresses) or "nothing"
    return Decision(
        False,
        None,
        f"host {host!r} resolves to {shown}: loopback, link-local, private or reserved addresses and the worker's "
        "own are refused unless an allow_egress_to_cidrs range admits them",
    )


def _decide_address(literal: _Address, ranges: Sequence[_Network], own: Sequence[str]) -> Decision:
    """The decision on a connection to the address ``literal`` itself."""
    if admitted(literal, ranges, own):
        return Decision(True, str(literal), "address in allow_egress_to_cidrs")
    guarded = guard(literal, own)
    if guarded is not None and any(_holds(net, literal) for net in ranges):
        block, what = guarded
        named = f"only {block} itself" if block.num_addresses == 1 else f"only a range inside {block}"
        return Decision(
            False,
            None,
            f"address {literal} is {what} ({block}): {named} in allow_egress_to_cidrs admits it, not a wider range",
        )
    return Decision(False, None, f"address {literal} is in no range of allow_egress_to_cidrs")
