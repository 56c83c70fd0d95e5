"""
The public guide's claims about the toolset (reference: seed-sandbox-guide.txt), walked in its order
against the real local backend, and, where a claim depends on the backend, against Docker and the
Modal fake too. The guards (durable, review, per-tool approval) are walked under dag.test() in
test_agent_guards.py.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from modal_server import modal_server_fixture  # noqa: F401 - the Modal stand-in's fixture
from pydantic_ai import Agent
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import RetryPromptPart

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec, SandboxTerminalError
from sandbox_provider.toolsets import SandboxToolset
from scripted_model import Script

pytestmark = requires_bwrap

try:  # the hosted stand-ins' fixtures, when their SDKs are installed
    from fake_boat import boat_hook, boat_service  # noqa: F401
    from fake_islo import islo_hook, islo_service  # noqa: F401
except ImportError:
    pass

MIB = 1024 * 1024


@pytest.fixture
def state_root(tmp_path):
    root = tmp_path / "sandboxes"
    root.mkdir()
    return root


@pytest.fixture
def local(state_root):
    return LocalSandboxHook(state_root=str(state_root))


def standing(state_root) -> list[str]:
    return sorted(p.name for p in state_root.iterdir() if p.name.startswith("airflow-sandbox-"))


def run(script: Script, *toolsets) -> Script:
    Agent(script.model, toolsets=list(toolsets)).run_sync("Work in the sandbox.")
    return script


@pytest.fixture
def modal(modal_server):
    """A Modal hook through the real modal SDK, over the Modal stand-in (its commands run in bubblewrap)."""
    from sandbox_provider.hooks.modal import ModalSandboxHook

    return ModalSandboxHook(modal_conn_id=None)


@pytest.fixture(params=["local", "docker", "modal", "islo", "boat", "sbx", "openshell"])
def backend(request, local, tmp_path, monkeypatch):
    """
    Each backend the claims that depend on one are walked against: (name, hook, spec). Docker is real; sbx is its CLI's stand-in over real containers; Modal, Islo,
    Boat and OpenShell are their real SDKs over stand-ins.
    """
    name = request.param
    if name == "local":
        yield name, local, SandboxSpec()
    elif name == "docker":
        from sandbox_provider.hooks.docker import DockerSandboxHook

        yield name, DockerSandboxHook(request.getfixturevalue("docker_conn")), SandboxSpec()
    elif name == "modal":
        yield name, request.getfixturevalue("modal"), SandboxSpec()
    elif name in ("islo", "boat"):
        pytest.importorskip({"islo": "islo", "boat": "boat_sdk"}[name])
        make = request.getfixturevalue(f"{name}_hook")
        # Boat cannot block egress: its sandboxes are open, and the toolset must say so.
        yield name, make(), SandboxSpec(block_network=name != "boat")
    elif name == "sbx":
        from sbx_fixtures import sbx_standin

        from conftest import DOCKER_IMAGE
        from sandbox_provider.hooks.sbx import SbxSandboxHook

        request.getfixturevalue("docker_client")
        with sbx_standin(tmp_path / "sbx", DOCKER_IMAGE) as standin:
            yield name, SbxSandboxHook(sbx_path=standin.path, host_network_policy="deny-all", memory="1g"), None
    else:
        pytest.importorskip("openshell")
        from openshell_gateway import FakeGateway

        from sandbox_provider.hooks.openshell import OpenShellSandboxHook

        gateway = FakeGateway(tmp_path / "gateway").start()
        host, port = gateway.endpoint.split(":")
        monkeypatch.setenv(
            "AIRFLOW_CONN_OPENSHELL_CLAIMS", f'{{"conn_type": "sandbox_openshell", "host": "{host}", "port": {port}}}'
        )
        monkeypatch.setattr(OpenShellSandboxHook, "poll_interval", 0.01)
        hook = OpenShellSandboxHook("openshell_claims")
        try:
            yield name, hook, SandboxSpec()
        finally:
            hook.close()
            gateway.stop()


# -- "A SandboxToolset gives an agent a sandbox with no network access and none of Airflow's credentials,
#     and deletes it when the agent run ends."


@pytest.fixture
def loopback_server():
    """A TCP server on the worker's loopback that answers 'hello': reachable only from the worker's network."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"hello")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


CONNECT = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', {port}), 5).recv(5).decode())\""


def test_default_sandbox_has_no_network_no_credentials_and_is_deleted(local, state_root, loopback_server, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgres://user:hunter2@db/warehouse")
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "not-for-the-sandbox")
    command = CONNECT.format(port=loopback_server)
    script = run(
        Script(
            [("run_command", {"command": command})],
            [("run_command", {"command": "env; cat /proc/net/dev"})],
            "done",
        ),
        SandboxToolset(local),
    )
    refused, env = script.texts()
    assert "ConnectionRefusedError" in refused and "[exit code: 1]" in refused  # its own loopback, empty
    assert "AIRFLOW" not in env and "hunter2" not in env
    interfaces = [line.split(":")[0].strip() for line in env.split("\n") if ":" in line and "|" not in line]
    assert interfaces[-1:] == ["lo"] and "eth0" not in interfaces
    assert standing(state_root) == []
    description = script.descriptions["run_command"]
    assert "This sandbox has no network access at all, not even DNS" in description
    assert "The sandbox and everything in it are deleted when this run ends." in description
    # The positive control: with block_network=False the same command reaches the worker's loopback.
    opened = run(
        Script([("run_command", {"command": command})], "done"),
        SandboxToolset(local, spec=SandboxSpec(block_network=False)),
    )
    assert opened.texts() == ["[stdout]\nhello"]


# -- "Control network access": the description says what the backend's mode lets through ------------------


@pytest.mark.parametrize(
    "spec",
    [SandboxSpec(), SandboxSpec(block_network=False), SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"])],
    ids=["blocked", "open", "cidrs"],
)
def test_the_description_carries_the_backends_own_account_of_the_network(backend, spec):
    _name, hook, _spec = backend
    description = SandboxToolset(hook, spec=spec).tool_definitions()[0].description
    assert hook.network_description(spec) in description


def test_modal_hostname_list_description_says_port_443_only_and_open_dns():
    from sandbox_provider.hooks.modal import ModalSandboxHook

    spec = SandboxSpec(allow_egress_to=["pypi.org", "files.pythonhosted.org"])
    description = SandboxToolset(ModalSandboxHook(modal_conn_id=None, egress_enforcement="sni"), spec=spec)
    text = description.tool_definitions()[0].description
    assert "only the hosts pypi.org and files.pythonhosted.org: only HTTPS (TLS) on port 443 reaches them" in text
    assert "DNS answers for every name" in text


def test_a_setting_the_backend_cannot_enforce_fails_before_anything_runs(local, state_root, modal, monkeypatch):
    from sandbox_provider.hooks import egress

    # A worker without the egress gateway's tools cannot enforce a hostname allowlist.
    monkeypatch.setattr(egress, "missing_tools", lambda **_: ["socat on the worker (apt-get install socat)"])
    script = Script([("run_command", {"command": "true"})], "done")
    with pytest.raises(SandboxTerminalError, match=r"needs socat on the worker.*drop the allow lists"):
        run(script, SandboxToolset(local, spec=SandboxSpec(allow_egress_to=["pypi.org"])))
    assert script.results == [] and standing(state_root) == []
    with pytest.raises(SandboxTerminalError, match=r"ModalSandboxHook\(egress_enforcement='sni'\)"):
        run(
            Script([("run_command", {"command": "true"})], "done"),
            SandboxToolset(modal, spec=SandboxSpec(allow_egress_to=["pypi.org"])),
        )


# -- "Size the sandbox and its timeouts" -------------------------------------------------------------------


class _Recording(LocalSandboxHook):
    """The local backend, recording the deadline each command was given."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.deadlines: list[float] = []

    def _run(self, handle, command, *, timeout, output):
        self.deadlines.append(timeout)
        return super()._run(handle, command, timeout=timeout, output=output)


def test_sixty_seconds_unless_asked_and_never_more_than_three_hundred(state_root):
    hook = _Recording(state_root=str(state_root))
    toolset = SandboxToolset(hook)
    assert (toolset.default_command_timeout, toolset.max_command_timeout) == (60, 300)
    script = run(
        Script(
            [("run_command", {"command": "true"})],
            [("run_command", {"command": "true", "timeout_seconds": 90})],
            [("run_command", {"command": "true", "timeout_seconds": 1000})],
            "done",
        ),
        toolset,
    )
    assert hook.deadlines == [60, 90, 300]
    assert "Commands get 60s unless you pass timeout_seconds (at most 300s)." in script.descriptions["run_command"]


# -- "Give two sandboxes to one agent" ---------------------------------------------------------------------


def test_two_sandboxes_need_a_prefix(local):
    with pytest.raises(UserError) as err:
        run(Script("never"), SandboxToolset(local), SandboxToolset(local))
    assert (
        "SandboxToolset 'sandbox-local' defines a tool whose name conflicts with existing tool from "
        "SandboxToolset 'sandbox-local': 'run_command'"
    ) in str(err.value)
    script = run(Script("done"), SandboxToolset(local, tool_prefix="py"), SandboxToolset(local, tool_prefix="node"))
    assert {"py_run_command", "node_run_command", "py_read_file", "node_list_directory"} <= set(script.tool_names)


# -- "Give code in the sandbox a credential" ---------------------------------------------------------------


def test_only_spec_env_reaches_the_sandbox_and_its_values_must_be_strings(local, monkeypatch):
    monkeypatch.setenv("WORKER_ONLY", "worker-secret")
    script = run(
        Script([("run_command", {"command": "echo ${API_TOKEN:-none} ${WORKER_ONLY:-none}"})], "done"),
        SandboxToolset(local, spec=SandboxSpec(env={"API_TOKEN": "scoped"})),
    )
    assert script.texts() == ["[stdout]\nscoped none"]
    with pytest.raises(ValueError, match=r"these entries do not: \['PORT'\].*str\(port\)"):
        SandboxSpec(env={"PORT": 8080})  # refused when the Dag is parsed, before any sandbox


def test_tool_output_passes_through_the_secret_masker(local):
    from airflow.sdk.log import mask_secret

    mask_secret("s3cr3t-t0k3n-value")
    script = run(Script([("run_command", {"command": "echo s3cr3t-t0k3n-value"})], "done"), SandboxToolset(local))
    assert script.texts() == ["[stdout]\n***"]


# -- "Get a file out" ---------------------------------------------------------------------------------------


def test_the_model_sees_at_most_50_kib_of_a_file_and_5_mib_is_the_read_limit(local):
    toolset = SandboxToolset(local)
    assert (toolset.max_output_bytes, toolset.max_read_bytes, toolset.max_export_bytes) == (50 * 1024, 5 * MIB, 1024**3)
    script = run(
        Script(
            [("run_command", {"command": "seq -w 1 20000 > many.txt && head -c 6000000 /dev/zero > big.bin"})],
            [("read_file", {"path": "many.txt"})],
            [("read_file", {"path": "big.bin"})],
            "done",
        ),
        toolset,
    )
    _, window, too_large = script.texts()
    shown, note = window.rsplit("\n", 1)
    assert len(shown.encode()) <= 50 * 1024 and shown.startswith("00001\n")
    kept = shown.count("\n") + 1
    assert note == f"[... {20000 - kept} more line(s); read on with offset={kept + 1}]"
    assert "'big.bin' is 5.7MB, over the 5.0MB read limit" in too_large


def test_exports_land_only_after_success_and_all_or_nothing(local, state_root, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    dest = tmp_path / "out" / "staging.csv"
    run(
        Script([("write_file", {"path": "staging.csv", "content": "a,b\n1,2\n"})], "done"),
        SandboxToolset(local, exports={"staging.csv": dest.as_uri()}),
    )
    assert dest.read_text() == "a,b\n1,2\n" and list(dest.parent.iterdir()) == [dest]  # no .partial left
    assert (
        "Copied staging.csv out of sandbox airflow-sandbox-" in caplog.text
        and f"Published {dest.as_uri()}" in caplog.text
    )
    # A named file that is missing fails the task, and no destination changes.
    other = tmp_path / "out" / "report.md"
    with pytest.raises(SandboxTerminalError, match="Could not export 'report.md'"):
        run(
            Script([("write_file", {"path": "staging.csv", "content": "new\n"})], "done"),
            SandboxToolset(local, exports={"staging.csv": dest.as_uri(), "report.md": other.as_uri()}),
        )
    assert dest.read_text() == "a,b\n1,2\n" and not other.exists()
    # A run that never called a tool has no sandbox standing.
    with pytest.raises(SandboxTerminalError) as err:
        run(Script("done"), SandboxToolset(local, exports={"staging.csv": dest.as_uri()}))
    assert str(err.value) == (
        "The run ended with no sandbox standing, so none of the files it was to export exist: 'staging.csv'."
    )
    assert standing(state_root) == []


def test_a_run_that_fails_exports_nothing(local, state_root, tmp_path):
    dest = tmp_path / "staging.csv"

    def fail(_texts):
        raise RuntimeError("the model gave up")

    with pytest.raises(RuntimeError, match="gave up"):
        run(
            Script([("write_file", {"path": "staging.csv", "content": "x\n"})], fail),
            SandboxToolset(local, exports={"staging.csv": dest.as_uri()}),
        )
    assert not dest.exists() and standing(state_root) == []


# -- "Share a sandbox between tasks" -------------------------------------------------------------------------


class _NotAttachable(FakeSandboxHook):
    name = "plain"
    attachable = False


def test_attach_to_needs_an_attachable_backend_when_the_dag_is_parsed(tmp_path):
    with pytest.raises(ValueError, match=r"attach_to needs a backend.*'plain' is not one.*Drop attach_to"):
        SandboxToolset(_NotAttachable(str(tmp_path)), attach_to="{{ ti.xcom_pull(task_ids='provision') }}")


def test_attach_checks_the_owner_leaves_the_sandbox_standing_and_logs_the_time_left(local, state_root, caplog):
    caplog.set_level(logging.INFO)
    handle = local.create(spec=SandboxSpec(owner="etl/run-1"))
    local.write_file(handle, "orders.csv", b"id\n1\n")
    script = run(
        Script([("run_command", {"command": "cat orders.csv"})], "done"),
        SandboxToolset(local, attach_to=handle, owner="etl/run-1"),
    )
    assert script.texts() == ["[stdout]\nid\n1"]
    assert standing(state_root) == [handle]  # left standing for a later task
    assert f"Attached to sandbox {handle} on backend local as etl/run-1; " in caplog.text
    assert "s of its lifetime remain" in caplog.text
    description = script.descriptions["run_command"]
    assert "provisioned by an earlier task for etl/run-1" in description
    assert local.network_description(SandboxSpec()) in description  # from the stamp
    with pytest.raises(SandboxTerminalError, match="is not owned by 'etl/run-2'"):
        run(Script("never"), SandboxToolset(local, attach_to=handle, owner="etl/run-2"))
    local.destroy(handle)


# -- "What happens when something fails" ---------------------------------------------------------------------

GUIDE_SEQUENCE = [
    "[stdout]\npartial\n[exit code: 3]",
    "(no output)\n[timed out after 2s]",
    "[stdout]\nkept across calls",
]


def test_failures_go_back_to_the_model_in_the_guides_shape(backend):
    _name, hook, spec = backend
    script = Script(
        [("write_file", {"path": "kept.txt", "content": "kept across calls\n"})],
        [("run_command", {"command": "echo partial; exit 3"})],
        [("run_command", {"command": "sleep 30", "timeout_seconds": 2})],
        [("run_command", {"command": "cat kept.txt"})],
        "done",
    )
    run(script, SandboxToolset(hook, spec=spec))
    assert script.texts() == [
        "Wrote 18 bytes to 'kept.txt'.",
        *GUIDE_SEQUENCE,
    ]  # the write first: later calls depend on it


def test_files_persist_between_calls_and_shell_variables_do_not(local):
    script = run(
        Script(
            [("run_command", {"command": "export STEP=one; echo one > step.txt"})],
            [("run_command", {"command": "echo ${STEP:-unset}; cat step.txt"})],
            "done",
        ),
        SandboxToolset(local),
    )
    assert script.texts() == ["(no output)", "[stdout]\nunset\none"]


def test_errors_the_model_can_fix_are_retries_and_those_it_cannot_fail_the_task(state_root):
    hook = LocalSandboxHook(state_root=str(state_root))
    script = run(
        Script(
            [("read_file", {"path": "missing.txt"})],
            [("run_command", {"command": "mkdir -p locked && touch locked/f && chmod 000 locked"})],
            [("read_file", {"path": "locked/f"})],
            "done",
        ),
        SandboxToolset(hook),
    )
    texts = script.texts()
    retries = [
        t
        for p, t in zip(script.results, texts, strict=True)
        if isinstance(p, RetryPromptPart) or p.outcome == "retried"
    ]
    assert len(retries) == 2, texts
    assert (
        "'missing.txt' does not exist" in retries[0]
        and "'locked/f' does not exist in the sandbox, or cannot be read" in retries[1]
    )

    class Unprovisionable(LocalSandboxHook):
        def _provision(self, request):
            raise SandboxTerminalError("The credentials were rejected.")

    with pytest.raises(SandboxTerminalError, match="credentials were rejected"):
        run(
            Script([("run_command", {"command": "true"})], "done"),
            SandboxToolset(Unprovisionable(state_root=str(state_root))),
        )


# -- "Clean up and control cost": a delete that fails is logged with the sandbox name ----------------------


def test_a_failed_delete_is_logged_and_does_not_fail_the_task(state_root, caplog):
    class Undeletable(LocalSandboxHook):
        # Both ways a destroy reaches the backend fail: the whole removal, and ending it without
        # waiting for the removal (what the session's last step asks for).
        def _destroy(self, handle):
            raise RuntimeError("the backend is away")

        def _end(self, handle):
            raise RuntimeError("the backend is away")

    hook = Undeletable(state_root=str(state_root))
    run(Script([("run_command", {"command": "true"})], "done"), SandboxToolset(hook))
    (handle,) = standing(state_root)
    assert f"Failed to destroy sandbox {handle} on backend local" in caplog.text
    LocalSandboxHook(state_root=str(state_root)).destroy(handle)


# -- exact output: truncation counts for 60,000 lines and one 5 MB line, on every backend ------------------


def test_truncation_counts_are_exact(backend):
    _name, hook, spec = backend
    script = run(
        Script(
            [("run_command", {"command": "seq 1 60000"})],
            [("run_command", {"command": "seq 1 60000 | wc -c"})],
            [("run_command", {"command": "head -c 5242880 /dev/zero | tr '\\0' x"})],
            "done",
        ),
        SandboxToolset(hook, spec=spec),
    )
    lines, size, one_line = script.texts()
    written = int(size.split("\n")[1])
    shown = "".join(f"{i}\n" for i in range(58001, 60001))
    assert lines == (
        f"[stdout]\n[... 58000 earlier lines ({written - len(shown)} bytes) not shown; the limits are 2000 lines "
        "and 50.0KB. Send the output to a file and read it in parts, or filter it with grep, head or tail.]\n"
        + shown.rstrip("\n")
    )
    assert written == 348894
    assert one_line == (
        f"[stdout]\n[... the first {5 * MIB - 50 * 1024} bytes of the last line not shown; the limits are 2000 "
        "lines and 50.0KB. Send the output to a file and read it in parts, or filter it with grep, head or tail.]\n"
        + "x"
        * (50 * 1024)
    )
