"""The egress gateway's decisions, with a resolver the test controls (nothing is looked up)."""

from __future__ import annotations

import os
import shutil

import pytest

from sandbox_provider.hooks import egress
from sandbox_provider.hooks.egress.rules import (
    EgressPolicy,
    address_ranges,
    check_ports,
    decide,
    host_pins,
    local_addresses,
    uncarved_guard,
)
from sandbox_provider.sandbox import SandboxSpec

POLICY = EgressPolicy(
    handle="airflow-sandbox-000000000000",
    hosts=("pypi.org", "*.pythonhosted.org", "mirror.internal.example"),
    cidrs=("203.0.113.0/24", "10.9.0.0/16"),
    ports=(443,),
    pins={"mirror.internal.example": ("10.1.2.3",)},
)


def resolver(table):
    asked = []

    def resolve(host, port):
        asked.append((host, port))
        if host not in table:
            raise OSError("no such name")
        return table[host]

    resolve.asked = asked
    return resolve


def test_listed_names_reach_public_addresses_on_allowed_ports():
    resolve = resolver({"pypi.org": ["151.101.0.223"], "files.pythonhosted.org": ["2a04:4e42::223"]})
    assert decide(POLICY, "pypi.org", 443, resolve).address == "151.101.0.223"
    assert decide(POLICY, "PyPI.org.", 443, resolve).allowed  # canonical: lowercased, no trailing dot
    assert decide(POLICY, "files.pythonhosted.org", 443, resolve).address == "2a04:4e42::223"


def test_unlisted_names_and_ports_are_refused_without_a_lookup():
    resolve = resolver({"pypi.org": ["151.101.0.223"], "evil.example": ["151.101.0.1"]})
    for host, port in [("evil.example", 443), ("pythonhosted.org", 443), ("pypi.org.evil.example", 443)]:
        assert not decide(POLICY, host, port, resolve).allowed
    refused = decide(POLICY, "pypi.org", 22, resolve)
    assert not refused.allowed and "port 22" in refused.reason
    assert resolve.asked == []


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "169.254.169.254",
        "10.0.0.5",
        "192.168.1.1",
        "172.16.0.1",
        "100.64.0.1",
        "0.0.0.0",
        "::1",
        "fe80::1",
        "fd00:ec2::254",
        "::ffff:127.0.0.1",
        "224.0.0.1",
        # IPv6 forms that carry loopback or link-local IPv4 addresses, judged by what they carry:
        "64:ff9b::7f00:1",
        "64:ff9b::a9fe:a9fe",
        "::127.0.0.1",
        "::ffff:169.254.169.254",
    ],
)
def test_listed_names_pointing_at_internal_addresses_are_refused(address):
    refused = decide(POLICY, "pypi.org", 443, resolver({"pypi.org": [address]}))
    assert not refused.allowed and "loopback, link-local, private or reserved" in refused.reason


def test_a_listed_range_admits_internal_results_and_literals_on_any_port():
    assert decide(POLICY, "pypi.org", 443, resolver({"pypi.org": ["10.9.3.4"]})).address == "10.9.3.4"
    assert decide(POLICY, "pypi.org", 443, resolver({"pypi.org": ["127.0.0.1", "10.9.3.4"]})).address == "10.9.3.4"
    assert decide(POLICY, "203.0.113.9", 22, resolver({})).allowed
    assert decide(POLICY, "[203.0.113.9]", 5432, resolver({})).allowed
    for literal in ("198.51.100.1", "127.0.0.1", "10.8.0.1", "::1"):
        assert not decide(POLICY, literal, 443, resolver({})).allowed


def test_pins_replace_the_lookup_and_are_trusted():
    resolve = resolver({})
    assert decide(POLICY, "mirror.internal.example", 443, resolve).address == "10.1.2.3"
    assert resolve.asked == []


def test_no_destination_and_unresolvable_names_are_refused():
    assert not decide(POLICY, None, None).allowed
    assert "does not resolve" in decide(POLICY, "pypi.org", 443, resolver({})).reason


def test_policy_round_trips_and_entries_are_checked():
    assert EgressPolicy.from_json(POLICY.to_json()) == POLICY
    spec = SandboxSpec(allow_egress_to=["PyPI.org", "pypi.org."], allow_egress_to_cidrs=["203.0.113.0/24"])
    policy = egress.policy_for("h", spec, ports=[443, 8443], pins={"pypi.org": "127.0.0.2"})
    assert policy.hosts == ("pypi.org",) and policy.ports == (443, 8443) and policy.pins == {"pypi.org": ("127.0.0.2",)}
    with pytest.raises(ValueError, match="such as '10.0.0.0/8'"):
        address_ranges(["10.0.0.1/8"])
    with pytest.raises(ValueError, match="not an address range"):
        address_ranges(["pypi.org"])
    for bad in ([], [0], [70000], "443", [True]):
        with pytest.raises(ValueError):
            check_ports(bad)
    with pytest.raises(ValueError, match="not a hostname"):
        host_pins({"127.0.0.1": "127.0.0.1"})
    with pytest.raises(ValueError, match="IP address"):
        host_pins({"pypi.org": "not-an-address"})


def test_proxy_variables_name_the_forwarder_in_both_cases():
    env = egress.proxy_env()
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["HTTP_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"


#: The worker's own addresses, as the gateway would read them from its interfaces.
OWN = ["127.0.0.1", "::1", "198.51.100.20", "2001:db8:77::5", "172.17.0.1"]


def ranges(*cidrs):
    return EgressPolicy(handle="h", cidrs=tuple(address_ranges(list(cidrs))))


def literal(cidrs, host):
    return decide(ranges(*cidrs), host, 80, resolver({}), local=lambda: OWN)


@pytest.mark.parametrize(
    ("cidrs", "host"),
    [
        (["0.0.0.0/0"], "127.0.0.1"),
        (["0.0.0.0/0"], "127.8.9.10"),
        (["0.0.0.0/1"], "127.0.0.1"),
        (["64.0.0.0/2"], "127.0.0.1"),
        (["0.0.0.0/0"], "169.254.169.254"),
        (["128.0.0.0/1"], "169.254.169.254"),
        (["0.0.0.0/0"], "0.0.0.0"),
        (["0.0.0.0/0"], "100.100.100.200"),
        (["::/0"], "::1"),
        (["::/0"], "[::1]"),
        (["::/0"], "::"),
        (["::/0"], "fe80::1"),
        (["::/0"], "fe80::1%eth0"),
        (["::/0"], "fd00:ec2::254"),
        (["fd00::/8"], "fd00:ec2::254"),
        # IPv4 carried in IPv6: mapped, compatible, NAT64 — judged by the IPv4 address.
        (["::/0"], "::ffff:127.0.0.1"),
        (["::/0"], "::ffff:169.254.169.254"),
        (["::/0"], "::127.0.0.1"),
        (["::/0"], "64:ff9b::7f00:1"),
        (["::/0"], "64:ff9b::a9fe:a9fe"),
        (["0.0.0.0/0"], "::ffff:127.0.0.1"),
        (["::ffff:0:0/96"], "::ffff:127.0.0.1"),
        (["64:ff9b::/96"], "64:ff9b::7f00:1"),
        # The worker's own addresses: only the address itself, listed alone, admits it.
        (["0.0.0.0/0"], "198.51.100.20"),
        (["198.51.100.0/24"], "198.51.100.20"),
        (["172.16.0.0/12"], "172.17.0.1"),
        (["::/0"], "2001:db8:77::5"),
        (["::/0"], "::ffff:198.51.100.20"),
    ],
)
def test_a_wide_range_never_admits_a_guarded_address(cidrs, host):
    refused = literal(cidrs, host)
    assert not refused.allowed and "admits it, not a wider range" in refused.reason, refused


@pytest.mark.parametrize(
    ("cidrs", "host"),
    [
        # Positive controls of the table above: the same addresses, their blocks named on purpose.
        (["127.0.0.0/8"], "127.8.9.10"),
        (["127.0.0.1/32"], "127.0.0.1"),
        (["169.254.169.254/32"], "169.254.169.254"),
        (["169.254.0.0/16"], "169.254.169.254"),
        (["0.0.0.0/32"], "0.0.0.0"),
        (["::1/128"], "::1"),
        (["fe80::/10"], "fe80::1"),
        (["fd00:ec2::254/128"], "fd00:ec2::254"),
        (["127.0.0.0/8"], "::ffff:127.0.0.1"),
        (["127.0.0.0/8"], "64:ff9b::7f00:1"),
        (["::ffff:127.0.0.0/104"], "127.0.0.1"),
        (["64:ff9b::7f00:0/104"], "64:ff9b::7f00:1"),
        (["198.51.100.20/32"], "198.51.100.20"),
        (["2001:db8:77::5/128"], "2001:db8:77::5"),
        # And what a catch-all still admits: addresses nobody guards.
        (["0.0.0.0/0"], "10.1.2.3"),
        (["0.0.0.0/0"], "198.51.100.21"),
        (["::/0"], "2001:db8::1"),
        (["::/0"], "::ffff:203.0.113.9"),
        (["::/0"], "64:ff9b::cb00:7109"),
    ],
)
def test_a_range_that_names_an_address_admits_it(cidrs, host):
    assert literal(cidrs, host).allowed


def test_listed_names_are_judged_by_what_they_resolve_to_and_carry():
    policy = EgressPolicy(handle="h", hosts=("pypi.org",), cidrs=("0.0.0.0/0", "::/0"))

    def to(*addresses):
        return decide(policy, "pypi.org", 443, resolver({"pypi.org": list(addresses)}), local=lambda: OWN)

    for address in ("64:ff9b::7f00:1", "::ffff:169.254.169.254", "198.51.100.20", "::1", "127.0.0.1"):
        assert not to(address).allowed, address
    # Positive controls: a public address, also in NAT64 form, and the first usable one of several.
    assert to("64:ff9b::cb00:7109").address == "64:ff9b::cb00:7109"
    assert to("151.101.0.223").allowed
    assert to("127.0.0.1", "198.51.100.20", "10.9.3.4").address == "10.9.3.4"  # private, under the catch-all
    specific = EgressPolicy(handle="h", hosts=("pypi.org",), cidrs=("127.0.0.0/8",))
    assert decide(specific, "pypi.org", 443, resolver({"pypi.org": ["64:ff9b::7f00:1"]}), local=lambda: OWN).allowed


def test_the_worker_s_own_addresses_are_read_from_its_interfaces():
    own = local_addresses()
    assert "127.0.0.1" in own and all("%" not in address for address in own)


@pytest.mark.parametrize(
    ("cidr", "block"),
    [
        ("0.0.0.0/0", "127.0.0.0/8"),
        ("128.0.0.0/1", "169.254.0.0/16"),
        ("::/0", "::1/128"),
        ("::ffff:0:0/96", "127.0.0.0/8"),
        ("64:ff9b::/96", "127.0.0.0/8"),
        ("fd00::/8", "fd00:ec2::254/128"),
        ("100.64.0.0/10", "100.100.100.200/32"),
        # Positive controls: ranges that name their block, or touch none.
        ("127.0.0.0/8", None),
        ("169.254.169.254/32", None),
        ("::ffff:127.0.0.0/104", None),
        ("203.0.113.0/24", None),
    ],
)
def test_a_range_covering_a_guarded_block_without_naming_it_is_found(cidr, block):
    import ipaddress

    found = uncarved_guard(ipaddress.ip_network(cidr))
    assert (str(found[0]) if found else None) == block


def test_the_connection_cap_is_checked_where_the_hooks_take_it():
    from sandbox_provider.hooks.docker import DockerSandboxHook
    from sandbox_provider.hooks.local import LocalSandboxHook

    assert egress.check_max_connections(1) == 1 and egress.check_max_connections(1024) == 1024
    for bad in (0, 1025, -1, 2.5, "64", True, None):
        with pytest.raises(ValueError, match="egress_max_connections must be a whole number"):
            egress.check_max_connections(bad)
    assert LocalSandboxHook(egress_max_connections=8).egress_max_connections == 8
    assert DockerSandboxHook(egress_max_connections=1024).egress_max_connections == 1024
    with pytest.raises(ValueError, match="egress_max_connections"):
        DockerSandboxHook("c", egress_max_connections=0)
    forward, _ = egress.docker_forward("/run/g", os.getpid(), 8)
    assert f"max-children={8 + egress.FORWARD_SPARE}" in forward[-2]


SCOPED_OWN = ["10.1.2.3", "fd00::5"]


@pytest.mark.parametrize("host", ["fd00::5", "[fd00::5%1]", "fd00::5%99", "::ffff:10.1.2.3%1", "[fd00::5%lo]"])
def test_a_scoped_form_of_the_worker_s_own_address_is_its_own_address(host):
    """A scope makes ``fd00::5%1`` unequal to ``fd00::5`` in Python, not to the kernel, which ignores it there."""
    decision = decide(EgressPolicy(handle="h", cidrs=("::/0", "0.0.0.0/0")), host, 80, local=lambda: SCOPED_OWN)
    assert not decision.allowed and "one of the worker's own addresses" in decision.reason
    only = EgressPolicy(handle="h", cidrs=("fd00::5/128", "10.1.2.3/32"))  # named on purpose: admitted
    assert decide(only, host, 80, local=lambda: SCOPED_OWN).allowed
    assert decide(EgressPolicy(handle="h", cidrs=("::/0",)), "fd00::6%1", 80, local=lambda: SCOPED_OWN).allowed


#: Runs as root in a network namespace of its own: gives its loopback fd00::5 (an address of "the worker"),
#: serves on it, starts a gateway with ``::/0`` and asks it for tunnels to that address, scoped and not.
SCOPED = r"""
import json, os, socket, subprocess, sys, tempfile, threading, time
from sandbox_provider.hooks import egress
from sandbox_provider.hooks.egress.rules import EgressPolicy
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "-6", "addr", "add", "fd00::5/128", "dev", "lo", "nodad"], check=True)
server = socket.socket(socket.AF_INET6)
server.bind(("fd00::5", 0))
server.listen(16)
port = server.getsockname()[1]

def serve():
    while True:
        conn, _ = server.accept()
        conn.sendall(b"reached the worker\n")
        conn.close()

threading.Thread(target=serve, daemon=True).start()
out = {"direct": socket.create_connection(("fd00::5%1", port), timeout=10).recv(100).decode().strip()}
directory = os.path.join(tempfile.mkdtemp(), "gateway")
pid = egress.start_gateway(
    directory, EgressPolicy(handle="scoped", cidrs=("::/0",)), expires_at=time.time() + 120, watch={"dir": directory}
)
try:
    for host in sys.argv[1:]:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(os.path.join(directory, egress.SOCKET))
        sock.settimeout(10)
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
        got = b""
        try:
            while (piece := sock.recv(4096)) and b"reached" not in got:
                got += piece
        except OSError:
            pass
        out[host] = got.split(b"\r\n")[0].decode() + (" reached" if b"reached the worker" in got else "")
finally:
    os.kill(pid, 15)
print(json.dumps(out))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="needs root, unshare and ip to give a network namespace of its own an address",
)
def test_a_scoped_form_of_the_worker_s_own_address_is_refused_by_a_real_gateway():
    import json
    import subprocess
    import sys

    hosts = ["[fd00::5]", "[fd00::5%1]", "[fd00::5%99]"]
    done = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", SCOPED, *hosts], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["direct"] == "reached the worker"  # positive control: the kernel takes the scoped form there
    assert got == {"direct": "reached the worker", **dict.fromkeys(hosts, "HTTP/1.1 403 Forbidden")}, got
