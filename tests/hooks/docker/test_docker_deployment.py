"""
``[sandbox] deployment`` on a real Docker Engine: every sandbox carries its deployment's name, and the
sweep at each create, ``remove_expired``, ``list_sandboxes``, ``find_sandboxes`` and ``airflow sandboxes``
consider only the sandboxes of the same deployment, so two deployments sharing an Engine never remove
each other's. Each test names its own deployments (below this worker's, which conftest.py sets).
"""

from __future__ import annotations

import os
import secrets
import time

import pytest

from sandbox_provider.cli import sweep as api
from sandbox_provider.sandbox.deployment import DEPLOYMENT_TAG, deployment
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG, OWNER_TAG

pytestmark = pytest.mark.docker

docker = pytest.importorskip("docker")

from conftest import DOCKER_IMAGE, container_gone  # noqa: E402
from sandbox_provider.hooks.docker import driver  # noqa: E402
from sandbox_provider.hooks.docker.hook import SANDBOX_LABEL, DockerSandboxHook  # noqa: E402


@pytest.fixture
def names():
    """Two deployment names of this test's own: ``(a, b)``."""
    base = f"{os.environ.get('AIRFLOW__SANDBOX__DEPLOYMENT') or 'tests'}-{secrets.token_hex(3)}"
    return f"{base}-a", f"{base}-b"


#: Seconds on at which the tests judge expiry; their leftovers end sooner, everything they make later.
LATER = 3600.0


class LaterHook(DockerSandboxHook):
    """The Docker hook, judging expiry :data:`LATER` seconds on (in the sweep of every create too)."""

    def remove_expired(self, *, owner=None, dag_id=None, now=None):
        return super().remove_expired(owner=owner, dag_id=dag_id, now=time.time() + LATER if now is None else now)


def _leftover(client, deployment_name: str, owner: str) -> str:
    """
    A container of the provider, of ``deployment_name`` (``""``: none), past its lifetime when judged
    :data:`LATER` seconds on. Not by the clock: then any other process's create on the Engine (one of an
    older version of the provider, which sweeps every deployment) could remove it in the middle of a test.
    """
    name = "airflow-sandbox-" + secrets.token_hex(6)
    labels = {
        SANDBOX_LABEL: name,
        driver.USER_LABEL: "65432:65432",
        OWNER_TAG: owner,
        EXPIRES_AT_TAG: str(int(time.time() + LATER / 2)),
        **driver.deployment_labels(deployment_name),
    }
    client.containers.run(DOCKER_IMAGE, ["sleep", "300"], name=name, labels=labels, detach=True)
    return name


def test_a_deployment_sweeps_only_its_own_sandboxes(docker_conn, docker_client, names, monkeypatch):
    a, b = names
    owner = f"dag_scope/{secrets.token_hex(4)}"
    left = _leftover(docker_client, a, owner)  # what a killed worker of deployment A left
    made: list[str] = []
    try:
        # Deployment B: its create sweeps the Engine, and its own sandbox carries its name; A's stays.
        monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", b)
        hook_b = LaterHook(docker_conn, pull="never", sandbox_timeout=2 * LATER)
        made.append(hook_b.create())
        labels = docker_client.api.inspect_container(made[-1])["Config"]["Labels"]
        assert labels[DEPLOYMENT_TAG] == b
        assert not container_gone(docker_client, left)
        assert hook_b.remove_expired() == [] and hook_b.remove_expired(owner=owner) == []
        assert [i.handle for i in hook_b.list_sandboxes()] == [made[-1]]
        assert hook_b.find_sandboxes({OWNER_TAG: owner}) == {}
        report = api.sweep([hook_b], now=time.time() + 3 * LATER)  # past every lifetime: only B's own go
        assert [item.record.handle for item in report.removed] == [made[-1]], report.lines()
        assert not container_gone(docker_client, left)

        # The unnamed deployment (the option empty) sees only sandboxes without a deployment label.
        monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", "")
        plain = LaterHook(docker_conn, pull="never")
        assert left not in {i.handle for i in plain.list_sandboxes(owner=owner)}
        assert plain.remove_expired(owner=owner) == []
        assert not container_gone(docker_client, left)

        # The positive control: deployment A lists its leftover, and A's next create removes it.
        monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", a)
        hook_a = LaterHook(docker_conn, pull="never", sandbox_timeout=2 * LATER)
        assert [i.handle for i in hook_a.list_sandboxes(owner=owner)] == [left]
        assert set(hook_a.find_sandboxes({OWNER_TAG: owner})) == {left}
        made.append(hook_a.create())
        assert container_gone(docker_client, left, within=10)
        assert docker_client.api.inspect_container(made[-1])["Config"]["Labels"][DEPLOYMENT_TAG] == a
    finally:
        for handle in [left, *made]:
            if not container_gone(docker_client, handle):
                docker_client.api.remove_container(handle, force=True)


def test_the_unnamed_deployment_leaves_named_ones_and_sweeps_its_own(docker_conn, docker_client, names, monkeypatch):
    a, _ = names
    owner = f"dag_scope/{secrets.token_hex(4)}"
    named, unnamed = _leftover(docker_client, a, owner), _leftover(docker_client, "", owner)
    try:
        monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", "")
        hook = LaterHook(docker_conn, pull="never")
        # Judged only for this owner: other sessions' unnamed leftovers on the Engine are not this test's to remove.
        assert hook.remove_expired(owner=owner) == [unnamed]
        assert container_gone(docker_client, unnamed, within=10) and not container_gone(docker_client, named)
    finally:
        for handle in (named, unnamed):
            if not container_gone(docker_client, handle):
                docker_client.api.remove_container(handle, force=True)


@pytest.mark.parametrize("bad", ["prod eu", "-prod", "prod-", "prod/eu", "x" * 64, "prod\neu", "é"])
def test_a_bad_deployment_name_fails_before_anything_is_provisioned(docker_conn, docker_client, monkeypatch, bad):
    monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", bad)
    hook = DockerSandboxHook(docker_conn, pull="never")
    with pytest.raises(SandboxTerminalError, match=r"\[sandbox\] deployment .*AIRFLOW__SANDBOX__DEPLOYMENT"):
        hook.create()
    with pytest.raises(SandboxTerminalError, match=r"\[sandbox\] deployment"):
        hook.remove_expired()
    assert hook._client_obj is None  # the Engine was never asked, so nothing was made there


def test_good_names_and_the_default(monkeypatch):
    for good in ("prod", "prod-eu", "Team_1.staging", "x" * 63, "  padded  "):
        monkeypatch.setenv("AIRFLOW__SANDBOX__DEPLOYMENT", good)
        assert deployment() == good.strip()
    monkeypatch.delenv("AIRFLOW__SANDBOX__DEPLOYMENT")
    assert deployment() == ""  # the provider's default, through Airflow's configuration
