"""The battery against real bubblewrap."""

from __future__ import annotations

import pytest

from conftest import requires_bwrap
from contract.battery import SandboxContract
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec

pytestmark = requires_bwrap


class TestLocalContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["https://pypi.org/simple"]), "is not a hostname"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.7/24"]), "no host bits"),
    ]

    @pytest.fixture
    def hook(self, tmp_path):
        return LocalSandboxHook(state_root=str(tmp_path / "state"))
