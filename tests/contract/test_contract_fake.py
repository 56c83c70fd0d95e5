"""The battery against the fake hook, which also tests ShellFiles and the shell guest programs under plain sh."""

from __future__ import annotations

import pytest

from contract.battery import SandboxContract
from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.hook import Capabilities


class TestFakeContract(SandboxContract):
    # The fake runs commands on the worker: its battery runs it as what it is, a backend without no_network.
    base_spec = SandboxSpec(block_network=False)
    refused_specs = [
        (SandboxSpec(), "cannot enforce a blocked network"),
        (SandboxSpec(allow_egress_to=["example.org"]), "cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["192.0.2.0/24"]), "allowlist of address ranges"),
        (SandboxSpec(block_network=False, env={"BIG": "x" * 200_000}), "more than the fake backend can pass"),
    ]

    @pytest.fixture
    def hook(self, tmp_path):
        return FakeSandboxHook(str(tmp_path), capabilities=Capabilities(no_network=False))

    def test_the_network_case_fails_a_backend_that_claims_a_block_it_does_not_enforce(self, tmp_path):
        liar = FakeSandboxHook(str(tmp_path))  # claims no_network (Capabilities' default), runs on the worker
        with pytest.raises(AssertionError, match=r"claims no_network .* connected to a listener on the worker's"):
            SandboxContract.test_a_blocked_sandbox_does_not_reach_the_worker(self, liar)
        assert list(tmp_path.iterdir()) == []  # the probed sandbox was destroyed
