"""
The deferred battery on the Modal backend: the real modal SDK over the Modal stand-in on loopback
(``tests/hooks/modal/modal_server.py``), which a worker and a triggerer process reach as the test does.
"""

from __future__ import annotations

import pytest
from deferred_battery import DeferredBattery
from modal_server import TOKEN, modal_server_fixture  # noqa: F401 - the stand-in's fixture


class TestDeferredModal(DeferredBattery):
    backend_code = """
    from sandbox_provider.hooks.modal import ModalSandboxHook

    BACKEND = ModalSandboxHook(modal_conn_id=None)
    """

    @pytest.fixture
    def backend_env(self, modal_server):
        self.server = modal_server
        return {"MODAL_SERVER_URL": modal_server.url, "MODAL_TOKEN_ID": TOKEN[0], "MODAL_TOKEN_SECRET": TOKEN[1]}

    def sandboxes(self, dag_id: str, run_id: str) -> list[str]:
        from sandbox_provider.sandbox.spec import DAG_ID_TAG, RUN_ID_TAG

        return sorted(
            record.sandbox_id
            for record in self.server.sandboxes.values()
            if record.result is None and record.tags.get(DAG_ID_TAG) == dag_id and record.tags.get(RUN_ID_TAG) == run_id
        )
