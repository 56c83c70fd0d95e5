"""The deferred battery on the real opensandbox-server on Docker, with the project's guest daemon."""

from __future__ import annotations

import os

import pytest
from deferred_battery import DeferredBattery

pytestmark = pytest.mark.docker


class TestDeferredOpenSandbox(DeferredBattery):
    backend_code = """
    from opensandbox_harness import FAST

    from sandbox_provider.hooks.opensandbox import OpenSandboxHook
    from sandbox_provider.sandbox import SandboxSpec

    BACKEND = OpenSandboxHook("sandbox_opensandbox_test")
    # The test server has no egress sidecar, so its sandboxes get an open network (see its contract test).
    SPEC = SandboxSpec(block_network=False, env=FAST)
    """

    @pytest.fixture
    def backend_env(self, opensandbox_conn, opensandbox_server):
        from opensandbox_harness import GUEST

        name = f"AIRFLOW_CONN_{opensandbox_conn.upper()}"
        return {name: os.environ[name], "PYTHONPATH": f"{GUEST}:{os.environ.get('PYTHONPATH', '')}"}

    @pytest.fixture(autouse=True)
    def _server(self, opensandbox_conn):
        self.conn_id = opensandbox_conn

    def sandboxes(self, dag_id: str, run_id: str) -> list[str]:
        from opensandbox.models.sandboxes import SandboxFilter

        from sandbox_provider.hooks.opensandbox import OpenSandboxHook, driver
        from sandbox_provider.sandbox.spec import DAG_ID_TAG, RUN_ID_TAG

        found = OpenSandboxHook(self.conn_id)._manager().list_sandbox_infos(SandboxFilter(page_size=200))
        return sorted(
            str(info.id)
            for info in found.sandbox_infos
            if str(info.status.state).lower() not in ("terminated", "failed", "stopping")
            and driver.decode_stamps(info.metadata or {}).get(DAG_ID_TAG) == dag_id
            and driver.decode_stamps(info.metadata or {}).get(RUN_ID_TAG) == run_id
        )
