"""
The real OpenSandbox server tier, below the hook: the ``opensandbox`` SDK against ``opensandbox-server``
(started by the ``opensandbox_server`` fixture) on the local Docker Engine, with the project's guest daemon.

These pin the vendor facts the hook is built on (``reference/backend-sdks.md`` §1.4): real containers,
the 60 s lifetime minimum, 404 on a second destroy, metadata that can be patched after create, sandboxes
that survive a server restart and expire on time, and a lost container surfacing mid-command.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("opensandbox")
pytest.importorskip("docker")

from opensandbox import SandboxSync  # noqa: E402
from opensandbox.exceptions import SandboxApiException, SandboxConnectionException  # noqa: E402
from opensandbox.models.execd import RunCommandOpts  # noqa: E402

pytestmark = pytest.mark.docker

try:
    from tests.opensandbox_harness import MARK, SANDBOX_IMAGE
except ImportError:  # tests/ is not a package: the test directory is on sys.path instead
    from opensandbox_harness import MARK, SANDBOX_IMAGE


def _create(server, *, lifetime: float = 300, **kwargs) -> SandboxSync:
    return SandboxSync.create(
        SANDBOX_IMAGE,
        timeout=timedelta(seconds=lifetime),
        ready_timeout=timedelta(seconds=60),
        connection_config=server.connection_config(),
        **kwargs,
    )


def _gone(server, sandbox_id: str, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while server.sandbox_container(sandbox_id) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture(scope="module")
def expiring(opensandbox_server):
    """A sandbox with the server's minimum lifetime (60 s), created first so its expiry overlaps the others."""
    sandbox = _create(opensandbox_server, lifetime=60, metadata={"purpose": "expiry"})
    return {"sandbox": sandbox, "created": time.monotonic()}


def test_create_runs_a_real_container_with_the_projects_guest_daemon(opensandbox_server, expiring):
    sandbox = _create(opensandbox_server, env={"GREETING": "hello"}, metadata={"owner-hint": "test"})
    try:
        container = opensandbox_server.sandbox_container(sandbox.id)
        assert container is not None and container.status == "running"
        assert f"{MARK}={opensandbox_server.token}" in container.attrs["Config"]["Env"]
        assert container.attrs["Config"]["Entrypoint"] == ["/opt/opensandbox/bootstrap.sh"]
        assert sandbox.get_info().metadata == {"owner-hint": "test"}
        execution = sandbox.commands.run("echo $GREETING; ps -eo args")
        out = [m.text for m in execution.logs.stdout]
        assert out[0] == "hello"
        assert any("/opt/opensandbox/execd" in line for line in out)
    finally:
        sandbox.destroy()
    assert _gone(opensandbox_server, sandbox.id)
    with pytest.raises(SandboxApiException) as err:
        sandbox.kill()
    assert err.value.status_code == 404


def test_a_lifetime_under_the_servers_minimum_is_refused(opensandbox_server):
    with pytest.raises(SandboxApiException) as err:
        _create(opensandbox_server, lifetime=59)
    assert err.value.status_code == 422
    assert "60" in str(err.value)


def test_metadata_can_be_patched_after_create_within_label_rules(opensandbox_server):
    sandbox = _create(opensandbox_server, metadata={"a": "1"})
    try:
        assert sandbox.patch_metadata({"b": "two", "a": None}).metadata == {"b": "two"}
        assert SandboxSync.connect(
            sandbox.id, connection_config=opensandbox_server.connection_config()
        ).get_info().metadata == {"b": "two"}
        with pytest.raises(SandboxApiException) as err:
            sandbox.patch_metadata({"c": "dag_run:x/y"})
        assert err.value.status_code == 400
    finally:
        sandbox.destroy()


def test_a_removed_container_fails_the_running_command(opensandbox_server):
    sandbox = _create(opensandbox_server)
    container = opensandbox_server.sandbox_container(sandbox.id)
    started = threading.Event()
    remover = threading.Thread(target=lambda: (started.wait(30), time.sleep(0.5), container.remove(force=True)))
    remover.start()
    try:
        with pytest.raises(SandboxConnectionException):
            sandbox.commands.run(
                "echo running; sleep 60",
                opts=RunCommandOpts(timeout=timedelta(seconds=90)),
                handlers=_on_first_stdout(started),
            )
    finally:
        remover.join()
    with pytest.raises(SandboxApiException) as err:
        sandbox.get_info()
    assert err.value.status_code == 404


def _on_first_stdout(event: threading.Event):
    from opensandbox.models.execd_sync import ExecutionHandlersSync

    return ExecutionHandlersSync(on_stdout=lambda _message: event.set())


def test_a_live_sandbox_survives_a_server_restart_and_then_expires_on_time(opensandbox_server, expiring):
    sandbox = expiring["sandbox"]
    opensandbox_server.restart()
    again = SandboxSync.connect(sandbox.id, connection_config=opensandbox_server.connection_config())
    assert again.commands.run("echo after-restart").exit_code == 0
    assert again.get_info().metadata == {"purpose": "expiry"}
    # The server restored its expiry timer from the container's labels: the sandbox goes at 60 s.
    remaining = 60 - (time.monotonic() - expiring["created"])
    assert _gone(opensandbox_server, sandbox.id, seconds=remaining + 30)
    with pytest.raises(SandboxApiException) as err:
        again.get_info()
    assert err.value.status_code == 404
