"""The battery against SbxSandboxHook and the stand-in sbx CLI, whose sandboxes are real containers."""

from __future__ import annotations

import pytest

from conftest import DOCKER_IMAGE
from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec

pytestmark = pytest.mark.docker


class TestSbxContract(SandboxContract):
    refused_specs = [
        (
            SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]),
            "sbx backend cannot enforce an egress allowlist of address",
        ),
        (SandboxSpec(owner="dag/run"), "owner"),
        (SandboxSpec(allow_egress_to=["http://pypi.org"]), "is not a hostname"),
        (SandboxSpec(env={"BAD-NAME": "x"}), "shell profile"),
    ]

    @pytest.fixture
    def hook(self, docker_client, tmp_path):
        from sbx_fixtures import sbx_standin

        from sandbox_provider.hooks.sbx import SbxSandboxHook

        with sbx_standin(tmp_path / "sbx", DOCKER_IMAGE) as standin:
            yield SbxSandboxHook(sbx_path=standin.path, host_network_policy="deny-all", memory="1g", cli_grace=5.0)
