"""The deferred battery on the Docker backend: real containers on this machine's Docker Engine."""

from __future__ import annotations

import pytest
from deferred_battery import DeferredBattery

docker = pytest.importorskip("docker")

IMAGE = "airflow-sandbox-python:bookworm"


@pytest.fixture(autouse=True, scope="module")
def _engine():
    try:
        docker.from_env().ping()
    except Exception as err:  # noqa: BLE001 - no Engine here: nothing to test against
        pytest.skip(f"no Docker Engine: {err}")


class TestDeferredDocker(DeferredBattery):
    long_seconds = 60
    every_case = True
    backend_code = f"""
    from sandbox_provider.hooks.docker import DockerSandboxHook

    BACKEND = DockerSandboxHook(image={IMAGE!r})
    """

    def sandboxes(self, dag_id: str, run_id: str) -> list[str]:
        from sandbox_provider.hooks.docker import DockerSandboxHook
        from sandbox_provider.sandbox.spec import DAG_ID_TAG, RUN_ID_TAG

        found = sorted(DockerSandboxHook().find_sandboxes({DAG_ID_TAG: dag_id, RUN_ID_TAG: run_id}))
        # A destroy kills the container and leaves its removal to the Engine (auto-remove), so a
        # destroyed sandbox can still be listed, stopped, for a moment: wait for the Engine to finish
        # removing each stopped one (up to 30 s); a running one, or one still there, is reported.
        client = docker.from_env()
        try:
            return [handle for handle in found if not self._removed_once_stopped(client, handle)]
        finally:
            client.close()

    @staticmethod
    def _removed_once_stopped(client, handle: str) -> bool:
        from conftest import container_gone

        try:
            state = client.api.inspect_container(handle)["State"]
        except docker.errors.NotFound:
            return True
        return not state.get("Running") and container_gone(client, handle, within=30)
