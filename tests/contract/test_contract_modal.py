"""The battery against ModalSandboxHook through the real modal SDK, over the Modal stand-in on loopback."""

from __future__ import annotations

import pytest
from modal_server import modal_server_fixture  # noqa: F401 - the stand-in's fixture

from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec


class TestModalContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["pypi.org"]), "egress_enforcement='sni'"),
        (SandboxSpec(allow_egress_to_cidrs=["10.0.0.0/8"]), "cannot reach"),
        (SandboxSpec(allow_egress_to_cidrs=["2001:db8::/32"]), "IPv6"),
        (SandboxSpec(allow_egress_to_cidrs=["0.0.0.0/0"]), "no allowlist at all"),
        (SandboxSpec(env={"BIG": "x" * 200_000}), "more than the Modal backend can pass"),
    ]

    @pytest.fixture
    def hook(self, modal_server):
        from sandbox_provider.hooks.modal import ModalSandboxHook

        return ModalSandboxHook(modal_conn_id=None)

    def test_the_owner_refusal_with_idle_timeout(self, hook, monkeypatch):
        """Modal's own refusal: an owner with idle_timeout would let Modal end the sandbox between tasks."""
        from sandbox_provider.hooks.modal import ModalSandboxHook
        from sandbox_provider.sandbox import SandboxTerminalError

        idle = ModalSandboxHook(modal_conn_id=None, idle_timeout=60)
        monkeypatch.setattr(idle, "_provision", lambda request: pytest.fail("provisioned"))
        with pytest.raises(SandboxTerminalError, match="idle_timeout"):
            idle.create(spec=SandboxSpec(owner="dag/run"))
