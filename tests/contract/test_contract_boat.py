"""The battery against the real boat-sdk, over the Boat stand-in on a loopback HTTP server."""

from __future__ import annotations

import pytest

pytest.importorskip("boat_sdk")

from tests.hooks.fake_boat import boat_hook, boat_service  # noqa: E402, F401

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
    def hook(self, boat_hook):  # noqa: F811
        return boat_hook()
