"""The egress gateway's decisions, with a resolver the test controls (nothing is looked up)."""

from __future__ import annotations

import pytest

from sandbox_provider.hooks import egress
from sandbox_provider.hooks.egress.rules import EgressPolicy, address_ranges, check_ports, decide, host_pins
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
