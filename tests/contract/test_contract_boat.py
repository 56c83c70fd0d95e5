"""The battery against the real boat-sdk, over the Boat stand-in on a loopback HTTP server."""

from __future__ import annotations

import pytest

pytest.importorskip("boat_sdk")

import fake_boat  # noqa: E402

boat_service, boat_hook = fake_boat.boat_service, fake_boat.boat_hook  # the stand-in's fixtures

from conftest import requires_bwrap  # noqa: E402
from contract.battery import SandboxContract  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402

pytestmark = requires_bwrap


class TestBoatContract(SandboxContract):
    base_spec = SandboxSpec(block_network=False)
    refused_specs = [
        (SandboxSpec(), "Boat backend cannot enforce a blocked network"),
        (SandboxSpec(allow_egress_to=["pypi.org"]), "cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "allowlist of address ranges"),
        (SandboxSpec(block_network=False, owner="dag/run"), "owner"),
    ]

    @pytest.fixture
    def hook(self, boat_hook):
        return boat_hook()
