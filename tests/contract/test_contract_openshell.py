"""The battery against OpenShellSandboxHook: the real SDK, gRPC to the in-process gateway double."""

from __future__ import annotations

import pytest

from conftest import requires_bwrap
from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec

pytest.importorskip("openshell")

pytestmark = requires_bwrap


class TestOpenShellContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(block_network=False), "OpenShell backend cannot enforce an open network"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "allowlist of address ranges"),
        (SandboxSpec(owner="dag/run"), "owner"),
        (SandboxSpec(allow_egress_to=["pypi.org:443"]), "is not a hostname"),
        (SandboxSpec(env={"SSL_CERT_FILE": "/x"}), "supervisor sets itself"),
    ]
    short_timeout = 1.0

    @pytest.fixture
    def hook(self, tmp_path, monkeypatch):
        from openshell_gateway import FakeGateway

        from sandbox_provider.hooks.openshell import OpenShellSandboxHook

        gateway = FakeGateway(tmp_path / "gateway").start()
        host, port = gateway.endpoint.split(":")
        monkeypatch.setenv(
            "AIRFLOW_CONN_OPENSHELL_CONTRACT", f'{{"conn_type": "sandbox_openshell", "host": "{host}", "port": {port}}}'
        )
        monkeypatch.setattr(OpenShellSandboxHook, "poll_interval", 0.01)
        hook = OpenShellSandboxHook("openshell_contract", relay_grace=2.0)
        yield hook
        hook.close()
        gateway.stop()
