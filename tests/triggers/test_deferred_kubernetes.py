"""The deferred battery on the Kubernetes backend, against the real cluster of scripts/kubernetes/prepare.sh."""

from __future__ import annotations

import os

import pytest
from deferred_battery import DeferredBattery

pytest.importorskip("kubernetes")


class TestDeferredKubernetes(DeferredBattery):
    backend_code = """
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    BACKEND = KubernetesSandboxHook("kubernetes_sandbox_test")
    """

    @pytest.fixture
    def backend_env(self, kubernetes_conn):
        name = f"AIRFLOW_CONN_{kubernetes_conn.upper()}"
        return {name: os.environ[name]}

    @pytest.fixture(autouse=True)
    def _conn(self, kubernetes_conn):
        self.conn_id = kubernetes_conn

    def sandboxes(self, dag_id: str, run_id: str) -> list[str]:
        from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook
        from sandbox_provider.sandbox.spec import DAG_ID_TAG, RUN_ID_TAG

        found = KubernetesSandboxHook(self.conn_id).find_sandboxes({DAG_ID_TAG: dag_id, RUN_ID_TAG: run_id})
        return sorted(found)
