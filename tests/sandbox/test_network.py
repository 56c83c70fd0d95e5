"""What each backend tells an agent its sandbox can reach: one wording, each backend's own facts."""

from __future__ import annotations

from typing import ClassVar

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.hooks import hook_classes
from sandbox_provider.hooks.docker import DockerSandboxHook
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.modal import ModalSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.hook import Capabilities
from sandbox_provider.sandbox.network import NetworkReach

NO_INSTALLS = "so installing packages or downloading anything will fail: work with what is already installed."
ONLY_THESE = "Nothing else answers, so installing packages from anywhere else will not work."
BLOCKED = SandboxSpec()
OPEN = SandboxSpec(block_network=False)
HOSTS = SandboxSpec(allow_egress_to=["pypi.org", "files.pythonhosted.org"])
CIDRS = SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"])
BOTH = SandboxSpec(allow_egress_to=["pypi.org"], allow_egress_to_cidrs=["203.0.113.0/24"])


def test_local():
    hook = LocalSandboxHook()
    assert hook.network_description(BLOCKED) == (
        "This sandbox has no network access at all, not even DNS: it has only a loopback interface of its own, "
        + NO_INSTALLS
    )
    assert hook.network_description(OPEN) == (
        "This sandbox shares the worker's network: it reaches whatever the worker reaches, on any port and DNS "
        "included, and localhost is the worker's, so services listening there answer too."
    )


def test_docker():
    hook = DockerSandboxHook()
    assert hook.network_description(BLOCKED) == (
        "This sandbox has no network access at all, not even DNS: its container has only a loopback interface, "
        + NO_INSTALLS
    )
    assert hook.network_description(OPEN) == (
        "This sandbox has outbound network access through the Docker network the backend is set to ('bridge' "
        "unless its network setting names another): any host and port the Docker host can reach, DNS included, "
        "and other containers on that network."
    )


GATEWAY_HOSTS = (
    "only through the proxy at http://127.0.0.1:3128 that HTTPS_PROXY and HTTP_PROXY name, which curl, pip, requests "
    "and urllib use, on port 443; the proxy resolves the names, DNS does not answer inside the sandbox and no address "
    "is routed, so a client that ignores the proxy variables fails, and a site served from the same address and port "
    "as a listed host is reached too"
)
GATEWAY_RANGES = (
    "any TCP port, only through the proxy at http://127.0.0.1:3128 that HTTPS_PROXY and HTTP_PROXY name, with HTTP "
    "CONNECT, so other TCP protocols need a client that tunnels through it; no address is routed otherwise and UDP "
    "goes nowhere; loopback, link-local (cloud metadata) and the worker's own addresses only where a range names "
    "them, never through a catch-all such as 0.0.0.0/0"
)


@pytest.mark.parametrize("hook", [LocalSandboxHook(), DockerSandboxHook()], ids=["local", "docker"])
def test_allowlists_through_the_egress_gateway(hook, monkeypatch):
    from sandbox_provider.hooks import egress

    monkeypatch.setattr(egress, "missing_tools", lambda **_: [])
    monkeypatch.setattr("os.geteuid", lambda: 0)  # the Docker forwarder needs a root worker
    assert hook.network_description(HOSTS) == (
        f"This sandbox can reach only the hosts pypi.org and files.pythonhosted.org: {GATEWAY_HOSTS}. {ONLY_THESE}"
    )
    assert hook.network_description(CIDRS) == (
        f"This sandbox can reach only the address ranges 203.0.113.0/24: {GATEWAY_RANGES}. {ONLY_THESE}"
    )
    assert hook.network_description(BOTH) == (
        f"This sandbox can reach only the hosts pypi.org ({GATEWAY_HOSTS}) and the address ranges 203.0.113.0/24 "
        f"({GATEWAY_RANGES}). Only listed names are resolved, and only by the proxy. {ONLY_THESE}"
    )


@pytest.mark.parametrize("hook", [LocalSandboxHook(), DockerSandboxHook()], ids=["local", "docker"])
@pytest.mark.parametrize("spec", [HOSTS, CIDRS, BOTH], ids=["hosts", "cidrs", "both"])
def test_allowlists_without_the_gateway_are_described_as_refused(hook, spec, monkeypatch):
    from sandbox_provider.hooks import egress

    monkeypatch.setattr(egress, "missing_tools", lambda **_: ["socat on the worker (apt-get install socat)"])
    text = hook.network_description(spec)
    assert text.startswith("No sandbox is provisioned with this network setting: The ")
    assert "through an egress gateway on the worker, which needs socat on the worker" in text


SNI = (
    "only HTTPS (TLS) on port 443 reaches them, matched by the server name in the TLS handshake, so plain HTTP and "
    "every other port fail or hang; DNS answers for every name, and a site served from the same TLS endpoint as a "
    "listed host can be reached too"
)
RANGES = (
    "any port and protocol reaches addresses in them; DNS answers for every name, but only addresses in these "
    "ranges can be reached"
)


def test_modal():
    strict, sni = ModalSandboxHook(modal_conn_id=None), ModalSandboxHook(modal_conn_id=None, egress_enforcement="sni")
    for hook in (strict, sni):
        assert hook.network_description(BLOCKED) == "This sandbox has no network access at all, not even DNS, " + (
            NO_INSTALLS
        )
        assert hook.network_description(OPEN) == (
            "This sandbox has outbound network access on any port, DNS included, except to Modal's metadata "
            "endpoint and private address ranges."
        )
        assert hook.network_description(CIDRS) == (
            f"This sandbox can reach only the address ranges 203.0.113.0/24: {RANGES}. {ONLY_THESE}"
        )
    assert sni.network_description(HOSTS) == (
        f"This sandbox can reach only the hosts pypi.org and files.pythonhosted.org: {SNI}. {ONLY_THESE}"
    )
    assert sni.network_description(BOTH) == (
        f"This sandbox can reach only the hosts pypi.org ({SNI}) and the address ranges 203.0.113.0/24 ({RANGES}). "
        f"Port 443 also reaches any address whose TLS server name is one of the listed hosts. {ONLY_THESE}"
    )
    # Without egress_enforcement="sni" a hostname list is refused, and the description says why.
    refused = strict.network_description(HOSTS)
    assert refused.startswith("No sandbox is provisioned with this network setting: SandboxSpec.allow_egress_to")
    assert "egress_enforcement='sni'" in refused


def test_only_the_network_fields_count():
    hook = LocalSandboxHook()
    assert hook.network_description(SandboxSpec(env={"A": "b"}, owner="d/r")) == hook.network_description(BLOCKED)


# -- how a new backend describes itself ------------------------------------------------------------------


class _Declared(FakeSandboxHook):
    capabilities = Capabilities(
        egress_hosts=True,
        network=NetworkReach(
            blocked="has no network: its proxy refuses every connection, and names resolve to nothing",
            hosts="over HTTP or HTTPS through the vendor's proxy, on ports 80 and 443",
        ),
    )


class _Overridden(_Declared):
    def describe_network(self, spec):
        return "Its network is whatever the host's policy allows." if not spec.block_network else None


def test_a_backend_declares_its_modes_in_its_capabilities(tmp_path):
    hook = _Declared(str(tmp_path))
    assert hook.network_description(BLOCKED) == (
        "This sandbox has no network: its proxy refuses every connection, and names resolve to nothing, " + NO_INSTALLS
    )
    assert hook.network_description(SandboxSpec(allow_egress_to=["example.org"])) == (
        "This sandbox can reach only the hosts example.org: over HTTP or HTTPS through the vendor's proxy, on ports "
        f"80 and 443. {ONLY_THESE}"
    )


def test_describe_network_overrides_a_mode_and_none_keeps_the_declared_wording(tmp_path):
    hook = _Overridden(str(tmp_path))
    assert hook.network_description(OPEN) == "Its network is whatever the host's policy allows."
    assert hook.network_description(BLOCKED) == _Declared(str(tmp_path)).network_description(BLOCKED)


def test_an_undeclared_backend_promises_only_what_the_contract_does(tmp_path):
    class Plain(FakeSandboxHook):
        capabilities: ClassVar[Capabilities] = Capabilities(egress_hosts=True, egress_cidrs=True)

    hook = Plain(str(tmp_path))
    # block_network=True is "no egress, DNS included" by the contract: a backend that cannot, refuses it.
    assert hook.network_description(BLOCKED).startswith("This sandbox has no network access at all, not even DNS,")
    assert "is up to the backend, so test before relying on" in hook.network_description(HOSTS)


# -- every backend describes every spec ------------------------------------------------------------------

GENERIC = ("is up to the backend", "has outbound network access.")


@pytest.mark.parametrize("hook_class", hook_classes(), ids=lambda cls: cls.name)
@pytest.mark.parametrize("spec", [BLOCKED, OPEN, HOSTS, CIDRS, BOTH], ids=["blocked", "open", "hosts", "cidrs", "both"])
def test_every_backend_words_every_setting_it_accepts_in_its_own_terms(hook_class, spec):
    # A new backend in HOOK_CLASSES fails here until it says what each mode it accepts lets through.
    text = hook_class().network_description(spec)
    assert text.startswith(("This sandbox", "The sandbox", "No sandbox is provisioned with this network setting: "))
    if not text.startswith("No sandbox"):
        assert not any(phrase in text for phrase in GENERIC), text


def test_islo_and_boat():
    from sandbox_provider.hooks.boat import BoatSandboxHook
    from sandbox_provider.hooks.islo import IsloSandboxHook

    islo, boat = IsloSandboxHook(), BoatSandboxHook()
    assert islo.network_description(BLOCKED) == (
        "This sandbox has no outbound network access: Islo has turned the sandbox's internet access off, " + NO_INSTALLS
    )
    assert islo.network_description(OPEN) == (
        "This sandbox has outbound internet access, turned on by Islo for the whole sandbox: no host or port is "
        "narrowed."
    )
    assert boat.network_description(OPEN) == (
        "This sandbox has open outbound network access, Boat's only mode: no host or port is narrowed."
    )
    assert "The Boat backend cannot enforce a blocked network" in boat.network_description(BLOCKED)
