"""IsloSandboxHook against the real islo SDK over the Islo stand-in: Islo's own rules, beyond the contract battery."""

from __future__ import annotations

import builtins
import io

import pytest

pytest.importorskip("islo")

import fake_islo  # noqa: E402
from fake_islo import API_KEY, COMPUTE_URL, CONTROL_URL  # noqa: E402

islo_service, islo_hook = fake_islo.islo_service, fake_islo.islo_hook  # the stand-in's fixtures

from conftest import requires_bwrap  # noqa: E402
from sandbox_provider.hooks.islo.hook import STREAM_KEEP, IsloSandboxBackend, IsloSandboxHook  # noqa: E402
from sandbox_provider.sandbox import (  # noqa: E402
    SandboxError,
    SandboxFileTooLargeError,
    SandboxSpec,
    SandboxTerminalError,
)

pytestmark = requires_bwrap

RUNNING_FOREVER = {"exec_id": "x", "status": "running", "stdout": "", "stderr": "", "truncated": False}


class Clock:
    """Stands in for the hook's monotonic clock and sleep: time passes only when the hook sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def runs(service, handle) -> str:
    """What the commands of a test appended to ``runs`` in the sandbox's workdir."""
    path = service.sandboxes[handle].host_path("runs")
    return path.read_text() if path.exists() else ""


def sh(hook, handle, command, timeout=60.0, max_output_bytes=64 * 1024):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=max_output_bytes)


# -- construction and connection ---------------------------------------------------------------------


def test_the_guide_name_and_the_connection_type():
    assert IsloSandboxBackend is IsloSandboxHook
    assert (IsloSandboxHook.conn_type, IsloSandboxHook.default_conn_name) == ("sandbox_islo", "sandbox_islo_default")


def test_construction_reads_no_connection_and_imports_no_sdk(monkeypatch):
    real_import = builtins.__import__

    def no_islo(name, *args, **kwargs):
        if name == "islo" or name.startswith("islo."):
            raise ImportError("no islo here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_islo)
    IsloSandboxHook("no_such_connection", vcpus=2)  # neither reads the connection nor imports islo
    hook = IsloSandboxHook(vcpus=2)
    from airflow.exceptions import AirflowOptionalProviderFeatureException

    with pytest.raises(AirflowOptionalProviderFeatureException, match=r"'\.\[islo\]' in a clone"):
        hook.create(spec=SandboxSpec())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vcpus": 0}, "vcpus must be a whole number"),
        ({"sandbox_timeout": 10}, "sandbox_timeout must be a whole number of seconds of at least 60"),
        ({"auto_resume": "sometimes"}, "auto_resume must be one of 'on_activity', 'never'"),
        ({"base_url": "http://islo.example.com"}, "base_url must be an https:// URL"),
        ({"workdir": "relative/dir"}, "workdir"),
    ],
)
def test_bad_arguments_fail_when_the_dag_is_parsed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IsloSandboxHook(**kwargs)


def test_a_named_connection_that_does_not_exist_says_what_to_do():
    with pytest.raises(SandboxTerminalError, match="'islo_missing' does not exist. Define it with type sandbox_islo"):
        IsloSandboxHook("islo_missing").create(spec=SandboxSpec())


def test_without_a_connection_or_key_it_names_both(monkeypatch):
    monkeypatch.delenv("ISLO_API_KEY", raising=False)
    with pytest.raises(SandboxTerminalError, match="password of connection 'sandbox_islo_default', or ISLO_API_KEY"):
        IsloSandboxHook().create(spec=SandboxSpec())


def test_without_a_connection_the_sdk_environment_variables_apply(islo_service, monkeypatch):
    import httpx

    monkeypatch.setenv("ISLO_API_KEY", API_KEY)
    monkeypatch.setenv("ISLO_BASE_URL", CONTROL_URL)
    monkeypatch.setenv("ISLO_COMPUTE_URL", COMPUTE_URL)
    monkeypatch.setattr(
        IsloSandboxHook, "_new_http_client", lambda self, timeout: httpx.Client(transport=islo_service.transport)
    )
    hook = IsloSandboxHook()
    handle = hook.create(spec=SandboxSpec())
    assert sh(hook, handle, "echo hi").stdout == "hi\n"


def test_a_wrong_api_key_is_a_credentials_error(islo_hook, add_connection):
    hook = islo_hook()
    add_connection(
        "sandbox_islo_default", "sandbox_islo", host=COMPUTE_URL, password="ak_wrong", extra={"base_url": CONTROL_URL}
    )
    with pytest.raises(SandboxTerminalError, match="Islo refused the credentials.*ISLO_API_KEY"):
        hook.create(spec=SandboxSpec())


def test_a_bad_extra_names_the_connection_and_the_extra(islo_hook):
    hook = islo_hook(extra={"vcpus": "many"})
    with pytest.raises(SandboxTerminalError, match="Connection 'sandbox_islo_default' extra 'vcpus'"):
        hook.create(spec=SandboxSpec())


@pytest.mark.parametrize(("host", "ok"), [("compute.islo.test", True), ("http://compute.islo.test", False)])
def test_the_compute_url_gets_https_or_is_refused(islo_hook, add_connection, host, ok):
    hook = islo_hook()
    add_connection("sandbox_islo_default", "sandbox_islo", host=host, password=API_KEY, extra={"base_url": CONTROL_URL})
    if ok:
        assert sh(hook, hook.create(spec=SandboxSpec()), "true").ok
    else:
        with pytest.raises(ValueError, match="must be an https:// URL"):
            hook.create(spec=SandboxSpec())


def test_connection_test_runs_a_command(islo_hook, islo_service):
    ok, message = islo_hook().test_connection()
    assert ok, message
    assert islo_service.sandboxes == {} and len(islo_service.deleted) == 1


# -- network, env, owner: refused before anything is provisioned --------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "remedy"),
    [
        (SandboxSpec(allow_egress_to=["pypi.org"]), "allow_egress_to", "drop the allowlists"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "allow_egress_to_cidrs", "block_network=False"),
        (SandboxSpec(env={"PATH": "/opt/bin"}), "PATH", "set PATH at the start of the command"),
        (SandboxSpec(owner="dag/run"), "owner", "attachable backend"),
    ],
)
def test_what_islo_cannot_enforce_is_refused_with_the_change_to_make(islo_hook, islo_service, spec, field, remedy):
    with pytest.raises(SandboxTerminalError) as caught:
        islo_hook().create(spec=spec)
    assert field in str(caught.value) and remedy in str(caught.value)
    assert islo_service.count("create") == 0 and islo_service.token_exchanges == 0


@pytest.mark.parametrize(("block", "internet"), [(True, False), (False, True)])
def test_the_network_switch_follows_block_network(islo_hook, islo_service, block, internet):
    handle = islo_hook().create(spec=SandboxSpec(block_network=block))
    assert islo_service.sandboxes[handle].request["internet_enabled"] is internet


# -- provisioning ------------------------------------------------------------------------------------


def test_create_sends_the_spec_sizing_and_lifecycle(islo_hook, islo_service):
    hook = islo_hook(image="python:3.12", vcpus=2, memory_mb=4096, sandbox_timeout=7200, pause_after_idle=120)
    handle = hook.create(spec=SandboxSpec(env={"TOKEN": "t"}))
    request = islo_service.sandboxes[handle].request
    assert request["name"] == handle and handle.startswith("airflow-sandbox-")
    assert (request["image"], request["vcpus"], request["memory_mb"]) == ("python:3.12", 2, 4096)
    assert (request["env"], request["workdir"]) == ({"TOKEN": "t"}, "/workspace")
    assert request["lifecycle"] == {"delete_after": 7200, "pause_after_idle": 120, "auto_resume": "on_activity"}


def test_defaults_leave_sizing_to_islo_and_pause_an_idle_sandbox(islo_hook, islo_service):
    handle = islo_hook().create(spec=SandboxSpec())
    request = islo_service.sandboxes[handle].request
    assert not {"image", "vcpus", "memory_mb", "disk_gb", "env"} & set(request)
    assert request["lifecycle"] == {"delete_after": 3600, "pause_after_idle": 600, "auto_resume": "on_activity"}


def test_the_deadline_never_outlasts_the_lifetime_counted_from_creation(islo_hook):
    hook = islo_hook(sandbox_timeout=60)
    handle = hook.create(spec=SandboxSpec())
    result = sh(hook, handle, "true", timeout=600)
    assert result.ok and result.applied_timeout <= 60


def test_a_starting_sandbox_is_waited_for(islo_hook, islo_service):
    islo_service.starting_polls = 2
    hook = islo_hook()
    hook._sleep = lambda seconds: None
    handle = hook.create(spec=SandboxSpec())
    assert islo_service.sandboxes[handle].status == "running"


def test_a_sandbox_islo_reports_failed_is_deleted_and_refused(islo_hook, islo_service):
    islo_service.new_status = "failed"
    with pytest.raises(SandboxTerminalError, match="as 'failed', not running; it was deleted"):
        islo_hook().create(spec=SandboxSpec())
    assert islo_service.sandboxes == {} and len(islo_service.deleted) == 1


def test_a_lost_create_answer_is_resent_under_the_same_name(islo_hook, islo_service):
    islo_service.fail("create", drop=True)
    hook = islo_hook()
    hook._sleep = lambda seconds: None
    handle = hook.create(spec=SandboxSpec())
    assert islo_service.count("create") == 2 and list(islo_service.sandboxes) == [handle]


def test_islo_retries_a_refused_create_for_its_request_timeout_and_deletes_nothing(islo_hook, islo_service):
    """A task's create (no Test): retried for request_timeout, not the 180 s a new sandbox may take to boot."""
    islo_service.fail("create", connect=True, times=10**6)
    hook = islo_hook(extra={"request_timeout": 20})
    clock = Clock()
    pauses: list[float] = []
    hook._monotonic, hook._sleep = clock, lambda seconds: pauses.append(seconds) or clock.sleep(seconds)
    began = clock.now
    with pytest.raises(SandboxTerminalError, match="ConnectError"):
        hook.create(spec=SandboxSpec())
    assert 10 <= clock.now - began <= 20 and len(pauses) >= 3  # it did retry, for as long as it may
    assert islo_service.count("delete") == 0  # no request got through, so there is nothing to delete


# -- commands ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [{"status": 503, "after": True}, {"drop": True}])
def test_an_exec_that_may_have_run_is_sent_exactly_once(islo_hook, islo_service, fault):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    islo_service.fail("exec", **fault)
    with pytest.raises(SandboxTerminalError, match="It may have run: it was not sent again"):
        sh(hook, handle, "echo ran >> runs")
    assert islo_service.count("exec") == 1
    for record in islo_service.sandboxes[handle].execs.values():
        assert record.done.wait(60)
    assert runs(islo_service, handle) == "ran\n"


@pytest.mark.parametrize(("fault", "reached"), [({"connect": True}, 1), ({"status": 429, "retry_after": "0"}, 2)])
def test_an_exec_that_cannot_have_run_is_sent_again(islo_hook, islo_service, fault, reached):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    slept: list[float] = []
    hook._sleep = slept.append
    islo_service.fail("exec", **fault)
    result = sh(hook, handle, "echo ran >> runs; echo done")
    assert result.ok and result.stdout == "done\n"
    assert islo_service.count("exec") == reached and len(slept) >= 1
    assert runs(islo_service, handle) == "ran\n"


def test_failures_while_polling_are_ridden_out(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    islo_service.fail("exec-result", status=503, times=3)
    assert sh(hook, handle, "echo fine").stdout == "fine\n"
    assert islo_service.count("exec") == 1


def test_output_past_islos_1_mib_cap_keeps_its_tail_and_says_truncated(islo_hook):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    script = "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo end; head -c 1500000 /dev/zero | tr '\\0' e >&2"
    result = sh(hook, handle, script, max_output_bytes=2 * 1024 * 1024)
    assert result.ok and result.stdout_truncated and result.stderr_truncated
    assert result.stdout.endswith("a\nend\n") and len(result.stdout) <= STREAM_KEEP
    assert set(result.stderr) == {"e"} and len(result.stderr) <= STREAM_KEEP


def test_a_command_with_no_result_by_its_deadline_deletes_the_sandbox(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    clock = Clock()
    hook._monotonic, hook._sleep = clock, clock.sleep
    islo_service.fail("exec-result", body=RUNNING_FOREVER, times=10**6)
    result = sh(hook, handle, "sleep 1", timeout=5)
    assert result.timed_out and result.sandbox_terminated and not result.ok
    assert f"sandbox {handle} was deleted to stop it" in result.stderr
    assert handle in islo_service.deleted and clock.now - 1000 >= 5
    with pytest.raises(SandboxTerminalError):
        sh(hook, handle, "true")


def test_a_result_islo_never_gives_is_terminal_and_leaves_the_sandbox(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    clock = Clock()
    hook._monotonic, hook._sleep = clock, clock.sleep
    islo_service.fail("exec-result", status=503, times=10**6)
    with pytest.raises(SandboxTerminalError, match="did not answer for the result.*may still be running"):
        sh(hook, handle, "true", timeout=5)
    assert handle in islo_service.sandboxes and islo_service.deleted == []


def test_an_islo_timeout_status_deletes_the_sandbox_too(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    islo_service.fail("exec-result", body={**RUNNING_FOREVER, "status": "timeout"}, times=10)
    result = sh(hook, handle, "true")
    assert result.timed_out and result.sandbox_terminated and handle in islo_service.deleted


def test_a_delete_that_fails_after_a_runaway_command_is_reported(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    clock = Clock()
    hook._monotonic, hook._sleep = clock, clock.sleep
    islo_service.fail("exec-result", body=RUNNING_FOREVER, times=10**6)
    islo_service.fail("delete", status=503, times=10**6)
    with pytest.raises(SandboxTerminalError, match="could not be deleted to stop it"):
        sh(hook, handle, "true", timeout=5)


def test_a_paused_sandbox_resumes_on_activity(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    islo_service.sandboxes[handle].status = "paused"
    assert sh(hook, handle, "echo back").stdout == "back\n"


def test_a_paused_sandbox_that_never_resumes_says_what_to_change(islo_hook, islo_service):
    hook = islo_hook(auto_resume="never")
    handle = hook.create(spec=SandboxSpec())
    islo_service.sandboxes[handle].status = "paused"
    with pytest.raises(SandboxTerminalError, match="auto_resume='on_activity' or a longer pause_after_idle"):
        sh(hook, handle, "true")
    assert islo_service.count("exec") == 1


def test_commands_run_in_the_workdir_under_islos_path(islo_hook):
    hook = islo_hook(workdir="/srv/job")
    handle = hook.create(spec=SandboxSpec(env={"A": "1"}))
    result = sh(hook, handle, 'pwd; echo "$A"; command -v sh')
    assert result.stdout == "/srv/job\n1\n/usr/bin/sh\n"


# -- files -------------------------------------------------------------------------------------------


def test_files_stream_through_islos_file_api(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    data = bytes(range(256)) * 4096
    assert hook.import_file(handle, "in/data.bin", io.BytesIO(data)) == len(data)
    assert islo_service.count("upload") == 1
    assert hook.read_file(handle, "/workspace/in/data.bin", max_bytes=len(data)) == data
    out = io.BytesIO()
    assert hook.export_file(handle, "in/data.bin", out, max_bytes=len(data)) == len(data)
    assert out.getvalue() == data and islo_service.count("download") == 2
    assert sorted(p.name for p in islo_service.sandboxes[handle].host_path("in").iterdir()) == ["data.bin"]


def test_a_read_over_the_limit_stops_and_reports_the_real_size(islo_hook):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    hook.write_file(handle, "big", b"z" * 200_000)
    with pytest.raises(SandboxFileTooLargeError) as caught:
        hook.read_file(handle, "big", max_bytes=1000)
    assert (caught.value.size_bytes, caught.value.max_bytes) == (200_000, 1000)


def test_a_failed_upload_leaves_no_file_behind(islo_hook, islo_service):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    hook.write_file(handle, "keep.txt", b"old")
    islo_service.fail("upload", status=503)
    with pytest.raises(SandboxError, match="writing 'keep.txt'"):
        hook.write_file(handle, "keep.txt", b"new")
    assert hook.read_file(handle, "keep.txt", max_bytes=10) == b"old"
    assert hook.list_directory(handle, ".") == [("keep.txt", False)]


def test_reading_from_a_deleted_sandbox_is_terminal(islo_hook):
    hook = islo_hook()
    handle = hook.create(spec=SandboxSpec())
    hook.destroy(handle)
    with pytest.raises(SandboxTerminalError, match="this worker destroyed it"):
        hook.read_file(handle, "x", max_bytes=10)
    hook._destroyed_because.clear()  # without this hook's record, Islo itself answers
    with pytest.raises(SandboxTerminalError, match="no sandbox"):
        hook.read_file(handle, "x", max_bytes=10)
