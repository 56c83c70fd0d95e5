"""BoatSandboxHook against the real boat-sdk over the Boat stand-in: Boat's own rules, beyond the contract battery."""

from __future__ import annotations

import builtins
import io
import json

import pytest

pytest.importorskip("boat_sdk")

import fake_boat  # noqa: E402
from fake_boat import API_KEY, WRITE_BODY_CAP  # noqa: E402

from conftest import requires_bwrap  # noqa: E402
from sandbox_provider.hooks.boat import hook as boat_module  # noqa: E402
from sandbox_provider.hooks.boat.hook import MAX_COMMAND_SECONDS, BoatSandboxBackend, BoatSandboxHook  # noqa: E402
from sandbox_provider.sandbox import SandboxError, SandboxSpec, SandboxTerminalError  # noqa: E402

boat_service, boat_hook = fake_boat.boat_service, fake_boat.boat_hook  # the stand-in's fixtures

pytestmark = requires_bwrap

OPEN = SandboxSpec(block_network=False)


def sh(hook, handle, command, timeout=60.0, max_output_bytes=64 * 1024):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=max_output_bytes)


def runs(service, handle) -> str:
    path = service.sandboxes[handle].host_path("runs")
    return path.read_text() if path.exists() else ""


@pytest.fixture
def no_sleep(boat_hook):
    """A hook whose pauses are recorded instead of slept."""
    hook = boat_hook()
    hook.slept = []
    hook._sleep = hook.slept.append
    return hook


# -- construction and connection ---------------------------------------------------------------------


def test_the_guide_name_and_the_connection_type():
    assert BoatSandboxBackend is BoatSandboxHook
    assert (BoatSandboxHook.conn_type, BoatSandboxHook.default_conn_name) == ("sandbox_boat", "sandbox_boat_default")


def test_construction_reads_no_connection_and_imports_no_sdk(monkeypatch):
    real_import = builtins.__import__

    def no_boat(name, *args, **kwargs):
        if name == "boat_sdk" or name.startswith("boat_sdk."):
            raise ImportError("no boat_sdk here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_boat)
    BoatSandboxHook("no_such_connection", machine_type="large")
    monkeypatch.setenv("BOAT_API_KEY", "k")
    from airflow.exceptions import AirflowOptionalProviderFeatureException

    with pytest.raises(AirflowOptionalProviderFeatureException, match=r"'\.\[boat\]' in a clone"):
        BoatSandboxHook().create(spec=OPEN)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"machine_type": "huge"}, "machine_type must be one of 'small', 'default', 'large', 'xlarge'"),
        (
            {"sandbox_timeout": 30 * 24 * 3600 + 1},
            "sandbox_timeout must be a whole number of seconds from 60 to 2592000",
        ),
        ({"ready_timeout": 0}, "ready_timeout"),
    ],
)
def test_bad_arguments_fail_when_the_dag_is_parsed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BoatSandboxHook(**kwargs)


def test_without_a_key_it_names_both_places(monkeypatch):
    monkeypatch.delenv("BOAT_API_KEY", raising=False)
    with pytest.raises(SandboxTerminalError, match="password of connection 'sandbox_boat_default', or BOAT_API_KEY"):
        BoatSandboxHook().create(spec=OPEN)


def test_without_a_connection_the_environment_variables_apply(boat_service, monkeypatch):
    monkeypatch.setenv("BOAT_API_KEY", API_KEY)
    monkeypatch.setenv("BOAT_BASE_URL", boat_service.url)
    hook = BoatSandboxHook()
    assert sh(hook, hook.create(spec=OPEN), "echo hi").stdout == "hi\n"


def test_a_plain_http_url_to_another_host_is_refused(add_connection):
    add_connection("sandbox_boat_default", "sandbox_boat", host="http://boat.example.com/api/v1", password="k")
    with pytest.raises(ValueError, match="must be an https:// URL"):
        BoatSandboxHook().create(spec=OPEN)


def test_a_wrong_api_key_is_a_credentials_error(boat_service, add_connection):
    add_connection("sandbox_boat_default", "sandbox_boat", host=boat_service.url, password="wrong")
    with pytest.raises(SandboxTerminalError, match="Boat refused the credentials.*BOAT_API_KEY"):
        BoatSandboxHook().create(spec=OPEN)


def test_connection_test_uses_an_open_network(boat_hook, boat_service):
    ok, message = boat_hook().test_connection()
    assert ok, message
    (sandbox,) = boat_service.sandboxes.values()
    assert sandbox.state == "archiving"


# -- network, env, owner: refused before anything is provisioned --------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (None, "a blocked network (block_network=True)"),
        (SandboxSpec(), "a blocked network (block_network=True)"),
        (SandboxSpec(allow_egress_to=["pypi.org"]), "an egress allowlist of hostnames (allow_egress_to)"),
        (
            SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]),
            "an egress allowlist of address ranges (allow_egress_to_cidrs)",
        ),
        (SandboxSpec(block_network=False, owner="dag/run"), "an owner"),
    ],
)
def test_what_boat_cannot_enforce_is_refused_with_the_change_to_make(boat_hook, boat_service, spec, field):
    with pytest.raises(SandboxTerminalError) as caught:
        boat_hook().create(spec=spec)
    message = str(caught.value)
    assert f"Boat backend cannot enforce {field}" in message
    assert "pass SandboxSpec(block_network=False) to accept an open network" in message
    assert boat_service.attempts == []


def test_env_names_a_shell_cannot_export_are_refused(boat_hook, boat_service):
    with pytest.raises(SandboxTerminalError, match=r"\['9LIVES', 'A-B'\] cannot be exported by a shell"):
        boat_hook().create(spec=SandboxSpec(block_network=False, env={"A-B": "x", "9LIVES": "y", "OK": "z"}))
    assert boat_service.attempts == []


# -- provisioning ------------------------------------------------------------------------------------


def test_create_sends_the_lifetime_size_and_env_under_an_idempotency_key(boat_hook, boat_service):
    handle = boat_hook(machine_type="large", sandbox_timeout=900).create(
        spec=SandboxSpec(block_network=False, env={"TOKEN": "t"})
    )
    request = boat_service.sandboxes[handle].request
    assert (request["type"], request["ttlSeconds"], request["env"]) == ("large", 900, {"TOKEN": "t"})
    assert (request["noEnv"], request["snapshots"]) == (True, False)
    assert request["name"].startswith("airflow-sandbox-") and list(boat_service.idempotency.values()) == [handle]


def test_the_deadline_never_outlasts_the_lifetime(boat_hook):
    hook = boat_hook(sandbox_timeout=60)
    result = sh(hook, hook.create(spec=OPEN), "true", timeout=300)
    assert result.ok and result.applied_timeout <= 60


def test_a_provisioning_sandbox_is_waited_for(no_sleep, boat_service):
    boat_service.provisioning_polls = 3
    handle = no_sleep.create(spec=OPEN)
    assert boat_service.sandboxes[handle].state == "ready" and no_sleep.slept


@pytest.mark.parametrize("fault", [{"drop": True}, {"status": 503, "after": True}])
def test_a_lost_create_answer_is_resent_once_under_the_same_key(no_sleep, boat_service, fault):
    boat_service.fail("create", **fault)
    handle = no_sleep.create(spec=OPEN)
    assert boat_service.count("create") == 2 and list(boat_service.sandboxes) == [handle]


def test_a_create_still_in_progress_is_asked_again(no_sleep, boat_service, monkeypatch):
    original = boat_service.serve
    answered = []

    def in_progress_once(method, parts, headers, body):
        if parts == ["sandboxes"] and not answered:
            answered.append(1)
            envelope = {"code": "idempotency_in_progress", "message": "still creating", "status": 409}
            return 409, {"ok": False, "type": "error", "requestId": "req_1", "error": envelope, **envelope}
        return original(method, parts, headers, body)

    monkeypatch.setattr(boat_service, "serve", in_progress_once)
    handle = no_sleep.create(spec=OPEN)
    assert boat_service.count("create") == 2 and handle in boat_service.sandboxes


def test_a_rate_limited_create_is_not_resent(no_sleep, boat_service):
    boat_service.fail("create", status=429, retry_after="7")
    with pytest.raises(SandboxError, match="rate limiting.*try again after 7 s"):
        no_sleep.create(spec=OPEN)
    assert boat_service.count("create") == 1 and no_sleep.slept == []


def test_a_sandbox_that_ends_before_it_is_ready_is_deleted(no_sleep, boat_service, monkeypatch):
    boat_service.provisioning_polls = 5
    original = boat_service.serve

    def error_on_get(method, parts, headers, body):
        if method == "GET" and len(parts) == 2:
            boat_service.sandboxes[parts[1]].state = "error"
        return original(method, parts, headers, body)

    monkeypatch.setattr(boat_service, "serve", error_on_get)
    with pytest.raises(SandboxTerminalError, match="ended as 'error' before it was ready"):
        no_sleep.create(spec=OPEN)
    (sandbox,) = boat_service.sandboxes.values()
    assert sandbox.deletion is not None


# -- commands ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "ran"),
    [
        ({"status": 503, "after": True, "retry_after": "1"}, True),
        ({"drop": True}, True),
        ({"status": 413, "retry_after": "1"}, False),
        ({"status": 429, "retry_after": "1"}, False),
        ({"status": 503, "retry_after": "1"}, False),
    ],
)
def test_a_command_is_sent_exactly_once_whatever_boat_answers(no_sleep, boat_service, fault, ran):
    handle = no_sleep.create(spec=OPEN)
    boat_service.fail("command", **fault)
    with pytest.raises(SandboxError):
        sh(no_sleep, handle, "echo ran >> runs")
    assert boat_service.count("command") == 1 and no_sleep.slept == []
    assert runs(boat_service, handle) == ("ran\n" if ran else "")


def test_a_lost_answer_says_the_command_may_have_run(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    boat_service.fail("command", drop=True)
    with pytest.raises(SandboxTerminalError, match="It may have run: it was not sent again"):
        sh(hook, handle, "true")


def test_a_command_boat_never_answers_is_tried_once(boat_hook, boat_service, monkeypatch):
    monkeypatch.setattr(boat_module, "KILL_AFTER", 0)
    monkeypatch.setattr(boat_module, "BOAT_MARGIN", 0)
    hook = boat_hook(request_timeout=1)
    handle = hook.create(spec=OPEN)
    boat_service.fail("command", hang=True)
    with pytest.raises(SandboxTerminalError, match="may have run"):
        sh(hook, handle, "true", timeout=1)
    assert boat_service.count("command") == 1


def test_boats_deadline_firing_means_the_sandbox_is_deleted(boat_hook, boat_service, monkeypatch):
    # Boat's deadline before the one inside the sandbox, as when the in-guest kill fails.
    monkeypatch.setattr(boat_module, "BOAT_MARGIN", -boat_module.KILL_AFTER - 2)
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    result = sh(hook, handle, "sleep 30", timeout=3)
    assert result.timed_out and result.sandbox_terminated and f"sandbox {handle} was deleted" in result.stderr
    assert boat_service.sandboxes[handle].state == "archiving"


def test_the_command_deadline_stays_under_boats_cap(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    result = sh(hook, handle, "true", timeout=3600)
    assert result.ok and result.applied_timeout == MAX_COMMAND_SECONDS
    assert boat_service.sandboxes[handle].commands[-1]["timeoutSeconds"] == 600


def test_a_command_that_kills_the_guest_program_gets_boats_status(boat_hook):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    # The command kills the guest program that runs it, so no status line comes back.
    result = sh(hook, handle, "echo before; kill -KILL $(cut -d' ' -f4 /proc/$PPID/stat)")
    assert (result.exit_code, result.stdout, result.timed_out) == (137, "", False)


def test_no_exit_status_from_boat_is_explained(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    answer = {
        "ok": True,
        "type": "command.finished",
        "success": False,
        "exitCode": None,
        "signal": "SIGKILL",
        "oomKilled": True,
        "stdout": "partial",
        "stderr": "",
        "timedOut": False,
    }
    boat_service.fail("command", body=answer)
    result = sh(hook, handle, "true")
    assert result.exit_code == -1 and result.stdout == "partial"
    assert "Boat reported no exit status for the command (it ran out of memory)" in result.stderr


def test_boats_own_truncation_is_reported(boat_hook, boat_service):
    boat_service.output_cap = 100
    hook = boat_hook()
    result = sh(hook, hook.create(spec=OPEN), "seq 1 1000 >&2; echo small")
    assert result.stderr_truncated and not result.stdout_truncated and result.stdout == "small\n"


def test_env_is_exported_again_after_the_login_profile(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=SandboxSpec(block_network=False, env={"MODE": "spec's", "PATH": "/opt/x:/usr/bin:/bin"}))
    profile = boat_service.sandboxes[handle].host_path("/home/user/.profile")
    profile.write_text("export MODE=profile PATH=/usr/bin:/bin FROM_PROFILE=yes\n")
    result = sh(hook, handle, 'printf "%s|%s|%s" "$MODE" "$PATH" "$FROM_PROFILE"')
    assert result.stdout == "spec's|/opt/x:/usr/bin:/bin|yes"


# -- files -------------------------------------------------------------------------------------------


def test_writes_under_home_go_through_boats_file_api_in_pieces(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    data = bytes(range(256)) * (7 * 4096) + b"end"  # 7 MiB and a bit: three pieces
    assert hook.import_file(handle, "data/blob.bin", io.BytesIO(data)) == len(data)
    assert boat_service.count("write") == 3
    assert boat_service.sandboxes[handle].host_path("data/blob.bin").read_bytes() == data
    assert hook.list_directory(handle, "data") == [("blob.bin", False)]
    assert hook.read_file(handle, "/home/user/data/blob.bin", max_bytes=len(data)) == data
    assert boat_service.count("read") == 0


def test_writes_elsewhere_go_through_the_shell(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    hook.write_file(handle, "/srv/out/x.txt", b"via the shell")
    assert boat_service.count("write") == 0
    assert hook.read_file(handle, "/srv/out/x.txt", max_bytes=100) == b"via the shell"


def test_a_path_boat_refuses_is_written_through_the_shell(boat_hook, boat_service):
    boat_service.refuse_writes_under = ["/home/user/linked"]
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    hook.write_file(handle, "linked/f.bin", b"\x00\x01 fell back")
    assert boat_service.count("write") == 1
    assert hook.read_file(handle, "linked/f.bin", max_bytes=100) == b"\x00\x01 fell back"
    assert hook.list_directory(handle, "linked") == [("f.bin", False)]


def test_every_native_write_fits_boats_body_limit(boat_hook, boat_service, monkeypatch):
    sizes = []
    original = boat_service.serve

    def measure(method, parts, headers, body):
        if method == "PUT":
            sizes.append(len(body))
            assert json.loads(body)["encoding"] == "base64"
        return original(method, parts, headers, body)

    monkeypatch.setattr(boat_service, "serve", measure)
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    hook.write_file(handle, "/tmp/big.bin", b"q" * (10 * 1024 * 1024))
    assert len(sizes) == 4 and max(sizes) < WRITE_BODY_CAP


def test_destroy_is_asynchronous_and_idempotent(boat_hook, boat_service):
    hook = boat_hook()
    handle = hook.create(spec=OPEN)
    hook.destroy(handle)
    assert boat_service.sandboxes[handle].state == "archiving"
    hook.destroy(handle)
    boat_service.finish_deletions()
    hook.destroy(handle)
    assert boat_service.count("delete") == 3
    # The hook remembers its own destroy and says so, rather than the vendor's "no sandbox".
    with pytest.raises(SandboxTerminalError, match="this worker destroyed it"):
        sh(hook, handle, "true")
    # A new hook (another task's) has no such memory: the vendor's answer stands.
    with pytest.raises(SandboxTerminalError, match="no sandbox"):
        sh(boat_hook(), handle, "true")
