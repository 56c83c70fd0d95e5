"""The battery against a real Kubernetes cluster (scripts/kubernetes/prepare.sh), as a worker bound to rbac.yaml."""

from __future__ import annotations

import pytest

from contract.battery import SandboxContract
from sandbox_provider.sandbox import SandboxSpec


class TestKubernetesContract(SandboxContract):
    refused_specs = [
        (SandboxSpec(allow_egress_to=["pypi.org"]), "cannot enforce an egress allowlist of hostnames"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.7/24"]), "no host bits"),
        (SandboxSpec(env={"NOT VALID": "x"}), "not valid Kubernetes environment variable names"),
    ]

    @pytest.fixture
    def hook(self, kubernetes_conn):
        from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

        return KubernetesSandboxHook(kubernetes_conn)
