"""SandboxOperator against real bubblewrap: XCom shape, failures, skips, exports, sharing, on_kill, bad inputs."""

from __future__ import annotations

import os
import threading
import time
from unittest import mock

import pytest
from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowSkipException

from conftest import requires_bwrap
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local.hook import wait_for_removals
from sandbox_provider.operators.sandbox import TAIL_CHARS, SandboxCommandError, SandboxOperator
from sandbox_provider.sandbox import SandboxSpec, SandboxTerminalError, dag_run_owner
from sandbox_provider.sandbox.spec import HOLDER_TAG, OWNER_TAG

pytestmark = requires_bwrap


class RecordingHook(LocalSandboxHook):
    """The real local backend, counting what was provisioned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.created: list[str] = []

    def create(self, *, spec=None):
        handle = super().create(spec=spec)
        self.created.append(handle)
        return handle


@pytest.fixture
def hook(tmp_path):
    return RecordingHook(state_root=str(tmp_path / "state"))


def sandboxes(hook):
    wait_for_removals()  # a task's destroy does not wait for the files to go
    return sorted(os.listdir(hook.state_root)) if os.path.isdir(hook.state_root) else []


def make_context(task_id="t", run_id="run-1", dag_id="d"):
    ti = mock.MagicMock(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=-1)
    return {"ti": ti, "run_id": run_id}


def render(op, context):
    op.render_template_fields(context)
    return op


# -- what a run gives back ------------------------------------------------------------------------------------


def test_xcom_is_small_and_names_where_exports_landed(hook, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("three\nlines\nhere\n")
    target = tmp_path / "out" / "count.txt"
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        files={"job.sh": "wc -l < data/in.txt > count.txt; echo counted; echo note >&2"},
        inputs={"data/in.txt": source.as_uri()},
        command="sh job.sh",
        exports={"count.txt": target.as_uri()},
    )
    result = op.execute(make_context())
    assert result == {
        "exit_code": 0,
        "stdout": "counted\n",
        "stderr": "note\n",
        "exports": {"count.txt": target.as_uri()},
    }
    assert target.read_text().strip() == "3"
    assert len(hook.created) == 1
    assert sandboxes(hook) == []  # destroyed


def test_output_tails_in_the_xcom_are_bounded(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="seq 1 100000; seq 1 50000 >&2")
    result = op.execute(make_context())
    assert len(result["stdout"]) <= TAIL_CHARS + 40 and result["stdout"].endswith("99999\n100000\n")
    assert result["stdout"].startswith("[... earlier output cut]")
    assert result["stderr"].endswith("50000\n")


def test_secrets_never_reach_the_xcom_or_the_failure_message(hook):
    from airflow.sdk.log import mask_secret

    secret = "Sup3rSecretValue42"
    mask_secret(secret)
    ok = SandboxOperator(task_id="t", backend=hook, command="echo using Sup3r''SecretValue42")
    assert secret not in repr(ok.execute(make_context()))
    # The backend keeps the last 40 bytes, cutting the secret in the middle: no piece of it is shown.
    cut = SandboxOperator(
        task_id="t",
        backend=hook,
        command="echo Sup3r''SecretValue42 and then a rather longer tail here",
        max_output_bytes=40,
    )
    shown = cut.execute(make_context())["stdout"]
    assert not any(secret[i : i + 4] in shown for i in range(len(secret) - 3))
    failing = SandboxOperator(task_id="t", backend=hook, command="echo Sup3r''SecretValue42 >&2; exit 3")
    with pytest.raises(SandboxCommandError) as info:
        failing.execute(make_context())
    assert secret not in str(info.value)


def test_a_command_rendering_to_nothing_fails_before_provisioning(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="{{ params.cmd }}", params={"cmd": ""})
    context = make_context()
    context["params"] = {"cmd": ""}
    with pytest.raises(ValueError, match="command rendered to ''"):
        render(op, context).execute(context)
    assert hook.created == []


def test_templated_command_and_export_url(hook, tmp_path):
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command="echo {{ run_id }} > id.txt",
        exports={"id.txt": f"{tmp_path.as_uri()}/{{{{ run_id }}}}/id.txt"},
    )
    context = make_context(run_id="run-42")
    render(op, context)
    assert op.command == "echo run-42 > id.txt"
    op.execute(context)
    assert (tmp_path / "run-42" / "id.txt").read_text() == "run-42\n"


def test_failing_command_fails_with_the_stderr_tail_and_exports_nothing(hook, tmp_path):
    target = tmp_path / "never.txt"
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command="echo partial > r.txt; seq 1 5000 >&2; echo 'the real reason' >&2; exit 3",
        exports={"r.txt": target.as_uri()},
    )
    with pytest.raises(SandboxCommandError, match=r"status 3") as err:
        op.execute(make_context())
    message = str(err.value)
    assert message.rstrip().endswith("the real reason")
    assert len(message) < TAIL_CHARS + 300
    assert not target.exists()
    assert sandboxes(hook) == []


def test_timeout_fails_and_destroys(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="echo started >&2; sleep 30", timeout=1)
    started = time.monotonic()
    with pytest.raises(SandboxCommandError, match=r"timeout of 1s.*\n.*started"):
        op.execute(make_context())
    assert time.monotonic() - started < 20
    assert sandboxes(hook) == []


@pytest.mark.parametrize("skip", [99, [1, 99], (99,)])
def test_skip_on_exit_code(hook, skip):
    op = SandboxOperator(task_id="t", backend=hook, command="exit 99", skip_on_exit_code=skip)
    with pytest.raises(AirflowSkipException, match="99"):
        op.execute(make_context())
    assert sandboxes(hook) == []


def test_other_exit_codes_still_fail_with_skip_codes_set(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="exit 4", skip_on_exit_code=99)
    with pytest.raises(SandboxCommandError, match="status 4"):
        op.execute(make_context())


def test_spec_env_reaches_the_sandbox_and_nothing_else(hook, monkeypatch):
    monkeypatch.setenv("WORKER_SECRET", "hunter22")
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        spec=SandboxSpec(env={"GREETING": "hello"}),
        command='echo "$GREETING/${WORKER_SECRET:-unset}"',
    )
    assert op.execute(make_context())["stdout"] == "hello/unset\n"


# -- backend resolution -----------------------------------------------------------------------------------------


def test_construction_touches_no_connection():
    with mock.patch.object(BaseHook, "get_connection", side_effect=AssertionError("parse-time lookup")) as get:
        SandboxOperator(task_id="t", backend="my_sandbox", command="true", exports={"a": "file:///tmp/a"})
    assert get.call_count == 0


def test_connection_id_is_resolved_when_the_task_runs(add_connection, tmp_path):
    state = tmp_path / "from-conn"
    add_connection("my_sandbox", "sandbox_local", extra={"state_root": str(state)})
    op = SandboxOperator(task_id="t", backend="my_sandbox", command="echo $HOME")
    assert op.execute(make_context())["stdout"] == "/workspace\n"
    assert wait_for_removals() and state.is_dir() and os.listdir(state) == []


def test_unknown_connection_type_fails_before_provisioning(add_connection, monkeypatch):
    monkeypatch.setattr(LocalSandboxHook, "create", mock.Mock(side_effect=AssertionError("provisioned")))
    add_connection("web", "http", host="example.com")
    op = SandboxOperator(task_id="t", backend="web", command="true")
    with pytest.raises(ValueError, match="type 'http', which no sandbox backend handles.*sandbox_local"):
        op.execute(make_context())


# -- bad inputs: clear errors, nothing provisioned ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ""}, "non-empty shell command"),
        ({"command": None}, "only with keep_sandbox=True"),
        ({"timeout": 0}, "timeout must be a positive"),
        ({"timeout": -5}, "timeout must be a positive"),
        ({"max_output_bytes": 0}, "max_output_bytes must be a whole, positive number of bytes"),
        ({"max_output_bytes": 1.5}, "max_output_bytes must be a whole, positive number of bytes"),
        (
            {"exports": {"out.txt": "out.txt"}},
            r"exports\['out.txt'\] is 'out.txt', which is not a storage URL",
        ),
        ({"exports": {"out.txt": ""}}, "not a storage URL"),
        ({"exports": {"out.txt": "file://relative/x"}}, "absolute path"),
        ({"exports": {"": "file:///tmp/x"}}, "path may not be empty"),
        ({"inputs": {"in": None}}, "not a storage URL"),
        ({"files": {"a.txt": 5}}, "text or bytes"),
        ({"attach_to": ""}, "not a sandbox handle"),
        ({"attach_to": "None"}, "not a sandbox handle"),
        ({"attach_to": "h", "spec": SandboxSpec()}, "spec cannot be combined with attach_to"),
        ({"sandbox_owner": "someone"}, "sandbox_owner applies to a sandbox shared"),
        ({"sandbox_owner": "a", "keep_sandbox": True, "spec": SandboxSpec(owner="b")}, "contradicts spec.owner"),
        ({"keep_sandbox": "yes"}, "keep_sandbox must be None, True or False"),
        ({"skip_on_exit_code": "99"}, "skip_on_exit_code"),
        ({"skip_on_exit_code": 0}, "0 is success"),
        ({"skip_on_exit_code": [1, 256]}, "from 1 to 255"),
        ({"backend": ""}, "backend must be"),
        ({"spec": {"env": {}}}, "spec must be a SandboxSpec"),
        ({"export_conn_id": ""}, "export_conn_id"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    args = {"task_id": "t", "command": "true", **kwargs}
    with pytest.raises(ValueError, match=message):
        SandboxOperator(**args)


def test_non_string_env_values_fail_when_the_spec_is_built():
    with pytest.raises(ValueError, match=r"env must map strings to strings.*\['PORT'\].*str\(port\)"):
        SandboxOperator(task_id="t", command="true", spec=SandboxSpec(env={"PORT": 8080}))


def test_attach_to_on_a_backend_that_cannot_attach_fails_at_construction(hook):
    class Unattachable(RecordingHook):
        attachable = False

    with pytest.raises(ValueError, match="attach_to needs a backend that can find a sandbox"):
        SandboxOperator(task_id="t", backend=Unattachable(), command="true", attach_to="airflow-sandbox-0123456789ab")


def test_rendered_bad_export_url_fails_before_provisioning(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="true", exports={"a": "{{ params.base }}/a"})
    context = {**make_context(), "params": {"base": ""}}
    render(op, context)
    with pytest.raises(ValueError, match=r"exports\['a'\] is '/a'"):
        op.execute(context)
    assert hook.created == []


def test_rendered_empty_handle_fails_before_anything_runs(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="true", attach_to="{{ params.handle }}")
    context = {**make_context(), "params": {"handle": None}}
    render(op, context)
    with pytest.raises(SandboxTerminalError, match="not a sandbox handle"):
        op.execute(context)
    assert hook.created == []


def test_missing_input_file_fails_before_provisioning(hook, tmp_path):
    op = SandboxOperator(task_id="t", backend=hook, command="true", inputs={"x": (tmp_path / "missing").as_uri()})
    with pytest.raises(SandboxTerminalError, match=r"inputs\['x'\] is file://.*missing, which does not exist"):
        op.execute(make_context())
    assert hook.created == [] and sandboxes(hook) == []


def test_input_failing_while_staged_removes_the_sandbox(hook, tmp_path, monkeypatch):
    source = tmp_path / "in.txt"
    source.write_text("here at task start")
    op = SandboxOperator(task_id="t", backend=hook, command="true", inputs={"x": source.as_uri()})
    real_create = hook.create

    def create_then_lose_the_input(*, spec=None):
        handle = real_create(spec=spec)
        source.unlink()  # gone between the check at task start and the staging
        return handle

    monkeypatch.setattr(hook, "create", create_then_lose_the_input)
    with pytest.raises(SandboxTerminalError, match="does not exist"):
        op.execute(make_context())
    assert len(hook.created) == 1 and sandboxes(hook) == []


# -- sharing a sandbox between tasks ----------------------------------------------------------------------------


def test_keep_attach_collect(hook, tmp_path):
    context = make_context(task_id="provision")
    handle = SandboxOperator(task_id="provision", backend=hook, keep_sandbox=True, command="echo 21 > n.txt").execute(
        context
    )
    assert sandboxes(hook) == [handle]
    assert hook.read_tags(handle)[OWNER_TAG] == dag_run_owner(context)  # stamped from the context

    double = SandboxOperator(
        task_id="double", backend=hook, attach_to=handle, command="echo $(( $(cat n.txt) * 2 )) > n.txt"
    )
    double.execute(make_context(task_id="double"))
    assert sandboxes(hook) == [handle]  # released, not destroyed
    assert HOLDER_TAG not in hook.read_tags(handle)

    target = tmp_path / "n.txt"
    collect = SandboxOperator(
        task_id="collect",
        backend=hook,
        attach_to=handle,
        command="cat n.txt",
        exports={"n.txt": target.as_uri()},
        keep_sandbox=False,
    )
    result = collect.execute(make_context(task_id="collect"))
    assert result["stdout"] == "42\n" and target.read_text() == "42\n"
    assert sandboxes(hook) == []
    assert hook.created == [handle]


def test_keep_sandbox_without_command_provisions_and_stages(hook, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("payload")
    handle = SandboxOperator(
        task_id="p", backend=hook, command=None, keep_sandbox=True, inputs={"in.txt": source.as_uri()}
    ).execute(make_context())
    try:
        assert hook.read_file(handle, "in.txt", max_bytes=100) == b"payload"
    finally:
        hook.destroy(handle)


def test_keep_sandbox_owner_argument_is_stamped(hook):
    handle = SandboxOperator(
        task_id="p", backend=hook, command=None, keep_sandbox=True, sandbox_owner="team-a"
    ).execute(make_context())
    try:
        assert hook.read_tags(handle)[OWNER_TAG] == "team-a"
        result = SandboxOperator(
            task_id="u", backend=hook, attach_to=handle, sandbox_owner="team-a", command="true"
        ).execute(make_context(run_id="another-run"))
        assert result["exit_code"] == 0
    finally:
        hook.destroy(handle)


def test_failed_provisioning_task_leaves_nothing_behind(hook):
    op = SandboxOperator(task_id="p", backend=hook, keep_sandbox=True, command="exit 1")
    with pytest.raises(SandboxCommandError):
        op.execute(make_context())
    assert len(hook.created) == 1 and sandboxes(hook) == []


def test_attach_from_another_dag_run_is_refused(hook):
    handle = SandboxOperator(task_id="p", backend=hook, command=None, keep_sandbox=True).execute(make_context())
    try:
        op = SandboxOperator(task_id="u", backend=hook, attach_to=handle, command="true")
        with pytest.raises(SandboxTerminalError, match="not owned by 'd/run-2'"):
            op.execute(make_context(run_id="run-2"))
        assert sandboxes(hook) == [handle]
    finally:
        hook.destroy(handle)


# -- on_kill -------------------------------------------------------------------------------------------------------


def test_on_kill_destroys_the_running_sandbox(hook):
    op = SandboxOperator(task_id="t", backend=hook, command="sleep 60", timeout=120)
    errors: list[BaseException] = []

    def run():
        try:
            op.execute(make_context())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not (op._session and op._session.handle) and time.monotonic() < deadline:
        time.sleep(0.05)
    handle = op._session.handle
    assert handle and sandboxes(hook) == [handle]
    op.on_kill()
    worker.join(30)
    assert not worker.is_alive()
    assert sandboxes(hook) == []
    assert errors  # the command did not finish normally


def test_on_kill_before_execute_is_harmless():
    SandboxOperator(task_id="t", command="true").on_kill()


def test_collect_destroys_even_when_its_command_fails(hook, tmp_path):
    handle = SandboxOperator(task_id="p", backend=hook, command=None, keep_sandbox=True).execute(make_context())
    target = tmp_path / "report.txt"
    collect = SandboxOperator(
        task_id="collect",
        backend=hook,
        attach_to=handle,
        command="test -s report.txt",
        exports={"report.txt": target.as_uri()},
        keep_sandbox=False,
    )
    with pytest.raises(SandboxCommandError, match="status 1"):
        collect.execute(make_context(task_id="collect"))
    assert sandboxes(hook) == [] and not target.exists()


def test_templated_input_url(hook, tmp_path):
    (tmp_path / "run-7").mkdir()
    (tmp_path / "run-7" / "in.txt").write_text("templated input")
    op = SandboxOperator(
        task_id="t",
        backend=hook,
        command="cat in.txt",
        inputs={"in.txt": f"{tmp_path.as_uri()}/{{{{ run_id }}}}/in.txt"},
    )
    context = make_context(run_id="run-7")
    render(op, context)
    assert op.execute(context)["stdout"] == "templated input"


def test_default_args_owner_stays_airflows_and_no_argument_shadows_baseoperator():
    import inspect

    from airflow.sdk import DAG, BaseOperator, task

    from sandbox_provider.decorators.sandbox import _SandboxDecoratedOperator as SandboxDecoratedOperator

    with DAG("owners", schedule=None, default_args={"owner": "data-team"}):
        op = SandboxOperator(task_id="job", command="true", keep_sandbox=True, sandbox_owner="d/r")

        @task.sandbox
        def add(a, b):
            return a + b

        decorated = add(1, 2).operator
    assert op.owner == "data-team" and decorated.owner == "data-team"
    assert op.sandbox_owner == "d/r"
    base = set(inspect.signature(BaseOperator.__init__).parameters) | {
        n for n in dir(BaseOperator) if not n.startswith("_")
    }
    for cls in (SandboxOperator, SandboxDecoratedOperator):
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs", "args"}
        assert not (own & base) - {"python_callable", "op_args", "op_kwargs", "multiple_outputs"}, own & base


# -- deferrable ----------------------------------------------------------------------------------------------


def test_deferrable_is_refused_at_parse_time_on_the_local_backend_naming_those_that_can(hook):
    for backend in (None, hook):
        with pytest.raises(ValueError, match="local backend's cannot: its sandboxes live on the worker") as err:
            SandboxOperator(task_id="t", command="true", backend=backend, deferrable=True)
        assert "Backends that can: Docker, Modal, OpenSandbox, Kubernetes." in str(err.value)


def test_deferrable_defaults_to_the_config_option(monkeypatch):
    assert SandboxOperator(task_id="t", command="true").deferrable is False
    monkeypatch.setenv("AIRFLOW__SANDBOX__DEFAULT_DEFERRABLE", "True")
    from sandbox_provider.hooks.docker import DockerSandboxHook

    assert SandboxOperator(task_id="t", command="true", backend=DockerSandboxHook()).deferrable is True
    assert SandboxOperator(task_id="t", command="true", backend="some_conn").deferrable is True
    with pytest.raises(ValueError, match="deferrable=True needs a backend"):
        SandboxOperator(task_id="t", command="true")
    assert SandboxOperator(task_id="t", command="true", deferrable=False).deferrable is False
    with pytest.raises(ValueError, match="deferrable must be True, False or None"):
        SandboxOperator(task_id="t", command="true", deferrable="yes")


def test_deferrable_with_a_connection_is_checked_before_anything_is_provisioned(hook, add_connection, tmp_path):
    add_connection("sandbox_local_here", "sandbox_local", extra={"state_root": str(tmp_path / "state")})
    op = SandboxOperator(task_id="t", command="true", backend="sandbox_local_here", deferrable=True)
    with pytest.raises(ValueError, match="local backend's cannot"):
        op.execute(make_context())
    assert not (tmp_path / "state").exists() or os.listdir(tmp_path / "state") == []
