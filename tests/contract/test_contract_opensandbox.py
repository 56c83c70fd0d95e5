"""
The battery against the real opensandbox-server on Docker, with the project's guest daemon, its wait after
each command turned off (``FAST``: the battery runs dozens of commands; the server tests keep the wait).
"""

from __future__ import annotations

import pytest
from opensandbox_harness import FAST

from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec

pytestmark = pytest.mark.docker


class TestOpenSandboxContract(SandboxContract):
    # The test server has no egress sidecar that enforces (dns+nft), so plain sandboxes get an open network;
    # the refusal of a blocked one after the sidecar's readback is in tests/hooks.
    base_spec = SandboxSpec(block_network=False, env=FAST)
    refused_specs = [
        (SandboxSpec(allow_egress_to=["https://pypi.org/simple"]), "is not a hostname"),
        (SandboxSpec(allow_egress_to_cidrs=["10.0.0.1/8"]), "is not an address range"),
        (SandboxSpec(block_network=False, env={"BIG": "x" * 200_000}), "more than the OpenSandbox backend can pass"),
    ]

    @pytest.fixture
    def hook(self, opensandbox_conn):
        from sandbox_provider.hooks.opensandbox import OpenSandboxHook

        return OpenSandboxHook(opensandbox_conn)
