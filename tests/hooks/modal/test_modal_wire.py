"""
The Modal stand-in against the installed ``modal`` SDK: every RPC the hook's calls reach is served,
the stand-in serves nothing the SDK no longer has, a mismatch fails naming the RPC, and the Modal
semantics the hook depends on hold (lifetime expiry, no network, a bare environment).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import modal_wire
import pytest
from grpclib import Status
from modal_proto.api_grpc import ModalClientBase
from modal_proto.task_command_router_grpc import TaskCommandRouterBase
from modal_server import TOKEN, ControlPlane, ModalServer, modal_server_fixture, point_sdk_at, sandbox_rpc  # noqa: F401
from modal_worker import Router

from sandbox_provider.hooks.modal import ModalSandboxHook
from sandbox_provider.sandbox import SandboxError, SandboxSpec

HERE = Path(__file__).resolve().parent


def walk_every_path(server: ModalServer, **hook_kwargs) -> str:
    """Drive the hook through each kind of call it makes, the lost-reply create included; return the handle."""
    create = "SandboxCreate" if "gpu" in hook_kwargs else sandbox_rpc("SandboxCreate")
    server.fail_next(create, Status.RESOURCE_EXHAUSTED, "reply lost", after=True)  # then found again by name
    hook = ModalSandboxHook(modal_conn_id=None, tags={"dag_id": "d"}, **hook_kwargs)
    handle = hook.create(spec=SandboxSpec(env={"A": "1"}, owner="dag/run"))
    hook.write_file(handle, "a.txt", b"data")
    assert hook.import_file(handle, "b.txt", io.BytesIO(b"more")) == 4
    assert hook.read_file(handle, "a.txt", max_bytes=10) == b"data"
    sink = io.BytesIO()
    assert hook.export_file(handle, "b.txt", sink, max_bytes=10) == 4 and sink.getvalue() == b"more"
    assert hook.list_directory(handle) == [("a.txt", False), ("b.txt", False)]
    assert hook.run_command(handle, 'echo "$A"; cat a.txt', timeout=10, max_output_bytes=100).stdout == "1\ndata"
    other = ModalSandboxHook(modal_conn_id=None)  # another task, knowing only the handle
    other.attach(handle, owner="dag/run", holder="dag/run/t")
    other.release(handle, holder="dag/run/t")
    assert hook.list_sandboxes({"dag_id": "d"}) == [handle]
    other.destroy(handle)
    return handle


@pytest.mark.parametrize("hook_kwargs", [{}, {"gpu": "T4"}], ids=["v2", "v1-gpu"])
def test_every_rpc_the_hooks_calls_reach_is_served(modal_server, hook_kwargs):
    handle = walk_every_path(modal_server, **hook_kwargs)
    default_version = 2 if sandbox_rpc("Sandbox").endswith("V2") else 1
    assert modal_server.sandbox(handle).version == (1 if hook_kwargs else default_version)
    called = {call.rpc for call in modal_server.calls}
    assert modal_server.unimplemented == []
    assert called <= modal_wire.served_rpcs(ControlPlane) | modal_wire.served_rpcs(Router)
    for family in (
        "SandboxCreate",
        "SandboxGetFromName",
        "TaskExecStart",
        "TaskExecStdinWrite",
        "SandboxTerminate",
    ):
        assert any(rpc.startswith(family) for rpc in called), f"the walk never reached {family}"


def test_the_stand_in_serves_only_rpcs_the_installed_sdk_has():
    modal_wire.check_served(ControlPlane, ModalClientBase)
    modal_wire.check_served(Router, TaskCommandRouterBase)


# -- a deliberate mismatch: the stand-in no longer serves an RPC the hook's calls reach ---------------------


#: The tags-read RPC, in both its forms: the installed SDK sends one of them.
TAGS_GET = ("SandboxTagsGet", "SandboxTagsGetV2")


def without() -> type:
    """The control plane with the tags-read RPC removed."""
    return type("ControlPlaneWithoutTagsGet", (ControlPlane,), {rpc: modal_wire.refusal(rpc) for rpc in TAGS_GET})


def renamed() -> type:
    """The control plane serving the tags-read RPC under another name, as after an SDK release renamed it."""
    handlers = {rpc: modal_wire.refusal(rpc) for rpc in TAGS_GET}
    handlers["SandboxTagsRead"] = ControlPlane.SandboxTagsGetV2
    return type("ControlPlaneRenamedTagsGet", (ControlPlane,), handlers)


@pytest.mark.parametrize("control_plane", [without(), renamed()], ids=["removed", "renamed"])
def test_a_mismatched_rpc_fails_naming_it(tmp_path, monkeypatch, control_plane):
    rpc = sandbox_rpc("SandboxTagsGet")
    server = ModalServer(tmp_path / "standin").start(control_plane=control_plane)
    try:
        point_sdk_at(server, monkeypatch)
        hook = ModalSandboxHook(modal_conn_id=None)
        handle = hook.create(spec=SandboxSpec())
        with pytest.raises(SandboxError, match=f"does not implement {rpc}"):
            hook.read_tags(handle)
    finally:
        server.stop()
    with pytest.raises(AssertionError, match=f"does not implement: {rpc}") as info:
        server.check_wire()
    print(info.value)  # the message a test meets
    if "SandboxTagsRead" in modal_wire.served_rpcs(control_plane):
        with pytest.raises(AssertionError, match="does not have: SandboxTagsRead"):
            modal_wire.check_served(control_plane, ModalClientBase)


INNER_TEST = """
import modal_server
import modal_wire
from modal_server import modal_server_fixture  # noqa: F401

from sandbox_provider.hooks.modal import ModalSandboxHook
from sandbox_provider.sandbox import SandboxSpec


class Missing(modal_server.ControlPlane):
    SandboxTagsGet = modal_wire.refusal("SandboxTagsGet")
    SandboxTagsGetV2 = modal_wire.refusal("SandboxTagsGetV2")


modal_server.ControlPlane = Missing


def test_that_swallows_the_error(modal_server):
    hook = ModalSandboxHook(modal_conn_id=None)
    handle = hook.create(spec=SandboxSpec())
    try:
        hook.read_tags(handle)
    except Exception:
        pass
"""


def test_a_test_that_swallows_the_hooks_error_still_fails_naming_the_rpc(tmp_path):
    """The ``modal_server`` fixture's own check: a run of one such test, in a pytest of its own."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TEST))
    # The stand-in's folder, and the suite's (the stand-in uses its pid_namespace helpers).
    path = [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'bt'}",
            "test_inner.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed, 1 error" in run.stdout
    assert f"does not implement: {sandbox_rpc('SandboxTagsGet')}" in run.stdout


# -- Modal's semantics the hook depends on ------------------------------------------------------------------


def test_the_client_hello_checks_the_token_pair(modal_server):
    import modal

    modal.Client.verify(modal_server.url, TOKEN)
    with pytest.raises(modal.exception.AuthError, match="not recognised"):
        modal.Client.verify(modal_server.url, ("ak-someone-else", "as-wrong"))
    assert [call.token_id for call in modal_server.calls] == [TOKEN[0], "ak-someone-else"]


def raw_sandbox(**kwargs):
    import modal

    app = modal.App.lookup("standin-checks", create_if_missing=True)
    return modal.Sandbox.create(app=app, image=modal.Image.from_registry("python:3.12-slim"), **kwargs)


def test_a_sandbox_ends_at_its_lifetime_and_runs_nothing_after(modal_server):
    import modal

    sandbox = raw_sandbox(timeout=2)
    running = sandbox.exec("sleep", "60", timeout=30)
    started = time.monotonic()
    with pytest.raises(modal.exception.SandboxTimeoutError):
        sandbox.wait()
    assert 1.5 < time.monotonic() - started < 10
    assert sandbox.poll() == 124  # Modal's status for a sandbox whose lifetime ran out
    with pytest.raises(modal.exception.NotFoundError):
        running.wait()
    with pytest.raises(modal.exception.NotFoundError):
        sandbox.exec("true", timeout=5)
    assert modal_server.running_commands() == {sandbox.object_id: []}


def test_the_first_command_of_a_fresh_sandbox_joins_a_ready_namespace(modal_server):
    """
    A sandbox's first command starts the holder of its namespaces and joins them at once. Bubblewrap
    reports the holder before it has mapped its user namespace's uids, and a command that joined in
    that moment failed with exit status 1 ("Can't send pid: Invalid argument"): seen under load as
    a first ``write_file`` that exited 1. For each fresh sandbox, the namespace must have its uid map
    the moment the holder is handed out, and a command started right then must run.
    """
    from modal_worker import BASE_ENV, ExecRecord, _hold, start

    async def first_command(record) -> tuple[str, int | None, bytes]:
        await _hold(record)
        (inside,) = Path(f"/proc/{record.holder.pid}/task/{record.holder.pid}/children").read_text().split()
        uid_map = Path(f"/proc/{inside}/uid_map").read_text().strip()  # read in the same step, nothing awaited
        command = ExecRecord(exec_id="ex-first", argv=["true"], workdir="/", env=dict(BASE_ENV), timeout_secs=30)
        record.execs[command.exec_id] = command
        await start(record, command)
        await command.done.wait()
        return uid_map.split()[:1][0] if uid_map else "", command.exit_code, bytes(command.output[2])

    hook = ModalSandboxHook(modal_conn_id=None)
    for _ in range(20):
        handle = hook.create(spec=SandboxSpec())
        assert modal_server.sandbox(handle).namespaces is None  # no command has run in it yet
        assert modal_server.run(first_command(modal_server.sandbox(handle))) == ("0", 0, b"")
        hook.destroy(handle)


def test_a_sandbox_has_no_network_whatever_it_asked_for(modal_server):
    """The stand-in cannot filter by hostname, so no sandbox reaches anything; what was asked for is recorded."""
    port = int(modal_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # positive control: the host reaches it
        pass
    hook = ModalSandboxHook(modal_conn_id=None)
    handle = hook.create(spec=SandboxSpec(block_network=False))
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    result = hook.run_command(handle, f'python -c "{probe}"', timeout=20, max_output_bytes=10_000)
    assert result.exit_code == 1 and ("Connection refused" in result.stderr or "unreachable" in result.stderr)
    assert not modal_server.sandbox(handle).network.blocked


def test_an_operation_of_the_filesystem_helper_the_stand_in_lacks_is_named(modal_server):
    import modal

    sandbox = raw_sandbox(timeout=60)
    with pytest.raises(modal.exception.SandboxFilesystemError):
        sandbox.filesystem.read_bytes("/etc/hostname")
    with pytest.raises(AssertionError, match="modal-sandbox-fs-tools ReadFile"):
        modal_server.check_wire()
    modal_server.unimplemented.clear()  # seen; the fixture's own check passes


# -- the SDK's error classes the hook names (some of its branches no stand-in answer reaches) --------------

USED_ERRORS = (
    "Error",
    "AlreadyExistsError",
    "AuthError",
    "ConflictError",
    "ConnectionError",
    "ExecTimeoutError",
    "InternalError",
    "InternalFailure",
    "InvalidError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SandboxFilesystemError",
    "SandboxFilesystemIsADirectoryError",
    "SandboxFilesystemNotADirectoryError",
    "SandboxFilesystemNotFoundError",
    "SandboxFilesystemPermissionError",
    "SandboxTerminatedError",
    "SandboxTimeoutError",
    "ServiceError",
)


def test_the_error_classes_the_hook_names_exist_in_the_order_it_checks_them():
    import modal.exception as exc

    missing = [name for name in USED_ERRORS if not isinstance(getattr(exc, name, None), type)]
    assert missing == [], f"modal.exception no longer has {missing}"
    assert issubclass(exc.ConflictError, exc.InvalidError)  # the hook checks ConflictError first
    assert issubclass(exc.SandboxFilesystemNotFoundError, exc.SandboxFilesystemError)
