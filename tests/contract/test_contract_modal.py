"""The battery against ModalSandboxHook over the fake ``modal`` SDK, whose commands run through the host's sh."""

from __future__ import annotations

import importlib
import sys

import fake_modal
import pytest

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
    def hook(self, monkeypatch, tmp_path):
        from sandbox_provider.hooks.modal import ModalSandboxHook

        mod = fake_modal.build()
        mod.Sandbox.run_on_host = True
        monkeypatch.setitem(sys.modules, "modal", mod)
        monkeypatch.setitem(sys.modules, "modal.exception", mod.exception)
        monkeypatch.setattr(importlib.import_module("airflow.providers.modal.hooks.modal"), "modal", mod)
        workdir = tmp_path / "workspace"
        workdir.mkdir()  # Modal makes the workdir of a new sandbox; the fake's sandboxes share this one
        return ModalSandboxHook(modal_conn_id=None, workdir=str(workdir))

    def test_the_owner_refusal_with_idle_timeout(self, hook, monkeypatch):
        """Modal's own refusal: an owner with idle_timeout would let Modal end the sandbox between tasks."""
        from sandbox_provider.hooks.modal import ModalSandboxHook
        from sandbox_provider.sandbox import SandboxTerminalError

        idle = ModalSandboxHook(modal_conn_id=None, workdir=hook.workdir, idle_timeout=60)
        monkeypatch.setattr(idle, "_provision", lambda request: pytest.fail("provisioned"))
        with pytest.raises(SandboxTerminalError, match="idle_timeout"):
            idle.create(spec=SandboxSpec(owner="dag/run"))
