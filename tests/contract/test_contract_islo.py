"""The battery against the real islo SDK, over the Islo stand-in at its HTTP transport."""

from __future__ import annotations

import pytest

pytest.importorskip("islo")

import fake_islo  # noqa: E402

islo_service, islo_hook = fake_islo.islo_service, fake_islo.islo_hook  # the stand-in's fixtures

from conftest import requires_bwrap  # noqa: E402
from contract.battery import SandboxContract  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402

pytestmark = requires_bwrap


class TestIsloContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["pypi.org"]), "Islo backend cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "allowlist of address ranges"),
        (SandboxSpec(env={"PATH": "/opt/bin"}), "Islo overwrites it"),
        (SandboxSpec(owner="dag/run"), "owner"),
    ]

    @pytest.fixture
    def hook(self, islo_hook):
        return islo_hook()
