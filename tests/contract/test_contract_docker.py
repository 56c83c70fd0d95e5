"""The battery against a real Docker Engine."""

from __future__ import annotations

import pytest

from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec

pytestmark = pytest.mark.docker


class TestDockerContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["https://pypi.org/simple"]), "is not a hostname"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.7/24"]), "no host bits"),
    ]

    @pytest.fixture
    def hook(self, docker_conn):
        from sandbox_provider.hooks.docker import DockerSandboxHook

        return DockerSandboxHook(docker_conn, pull="never")
