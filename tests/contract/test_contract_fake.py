"""The battery against the fake hook, which also tests ShellFiles and the shell guest programs under plain sh."""

from __future__ import annotations

import pytest

from contract.battery import SandboxContract
from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.hook import Capabilities


class TestFakeContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["example.org"]), "cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["192.0.2.0/24"]), "allowlist of address ranges"),
        (SandboxSpec(env={"BIG": "x" * 200_000}), "more than the fake backend can pass"),
    ]

    @pytest.fixture
    def hook(self, tmp_path):
        return FakeSandboxHook(str(tmp_path))

    def test_no_network_capability_refuses_a_bare_spec(self, tmp_path):
        from sandbox_provider.sandbox import SandboxTerminalError

        hook = FakeSandboxHook(str(tmp_path), capabilities=Capabilities(no_network=False))
        with pytest.raises(SandboxTerminalError, match=r"cannot enforce a blocked network.*weaker than asked"):
            hook.create()
        assert hook.calls == []
