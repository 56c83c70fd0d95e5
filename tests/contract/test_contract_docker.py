"""The battery against a real Docker Engine."""

from __future__ import annotations

import pytest

from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec

pytestmark = pytest.mark.docker


class TestDockerContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["pypi.org"]), "Docker backend cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "allowlist of address ranges"),
    ]

    @pytest.fixture
    def hook(self, docker_conn):
        from sandbox_provider.hooks.docker import DockerSandboxHook

        return DockerSandboxHook(docker_conn, pull="never")
