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

        return sorted(DockerSandboxHook().find_sandboxes({DAG_ID_TAG: dag_id, RUN_ID_TAG: run_id}))
