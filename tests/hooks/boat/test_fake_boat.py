"""The Boat stand-in, driven by the real ``boat-sdk``: its JSON must satisfy the SDK's strict models."""

from __future__ import annotations

import base64
import uuid

import pytest

boat_sdk = pytest.importorskip("boat_sdk")

import urllib3  # noqa: E402
from boat_sdk.exceptions import ApiException, BadRequestException, NotFoundException, ServiceException  # noqa: E402
from boat_sdk.models import CommandRequest, CreateSandboxRequest, FileWriteRequest  # noqa: E402
from fake_boat import WRITE_BODY_CAP, FakeBoat  # noqa: E402

from conftest import requires_bwrap  # noqa: E402

pytestmark = requires_bwrap

NO_RETRIES = urllib3.util.Retry(total=0, connect=0, read=0, redirect=0, status=0, other=0)


@pytest.fixture
def fake(tmp_path):
    service = FakeBoat(tmp_path / "boat")
    yield service
    service.close()


def create(api, **fields):
    request = CreateSandboxRequest(type="default", ttl_seconds=600, no_env=True, snapshots=False, **fields)
    return api.create(idempotency_key=str(uuid.uuid4()), create_sandbox_request=request).sandbox


def run(api, sandbox_id, command, timeout_seconds=60, **kwargs):
    response = api.command(sandbox_id, CommandRequest(command=command, timeout_seconds=timeout_seconds), **kwargs)
    return response.actual_instance


def test_create_is_idempotent_under_the_same_key(fake):
    api = fake.api()
    request = CreateSandboxRequest(type="small", ttl_seconds=900, name="airflow-sandbox-abc", env={"A": "1"})
    first = api.create(idempotency_key="key-1", create_sandbox_request=request)
    again = api.create(idempotency_key="key-1", create_sandbox_request=request)
    assert first.sandbox.id == again.sandbox.id and len(fake.sandboxes) == 1
    assert (first.type, first.status, first.ttl_seconds) == ("sandbox.created", "ready", 900)
    assert (first.sandbox.name, first.sandbox.type) == ("airflow-sandbox-abc", "small")
    assert fake.sandboxes[first.sandbox.id].request["env"] == {"A": "1"}


def test_commands_run_for_real_in_the_home_directory(fake):
    api = fake.api()
    sandbox = create(api, env={"GREETING": "hi"})
    result = run(api, sandbox.id, 'echo "$GREETING"; pwd; echo oops >&2; exit 7')
    assert (result.type, result.exit_code, result.success, result.timed_out) == ("command.finished", 7, False, False)
    assert result.stdout == "hi\n/home/user\n"
    assert result.stderr == "oops\n"


def test_boat_enforces_its_own_deadline(fake):
    api = fake.api()
    sandbox = create(api)
    result = run(api, sandbox.id, "echo before; sleep 30", timeout_seconds=1)
    assert (result.timed_out, result.exit_code, result.signal, result.stdout) == (True, None, "SIGKILL", "before\n")


def test_boat_caps_each_stream_and_says_so(fake):
    fake.output_cap = 10
    api = fake.api()
    sandbox = create(api)
    result = run(api, sandbox.id, "seq 1 100")
    assert result.stdout_truncated and not result.stderr_truncated and result.stdout == "1\n2\n3\n4\n5\n"


def test_the_sdk_refuses_a_zero_timeout_before_sending():
    with pytest.raises(ValueError):
        CommandRequest(command="true", timeout_seconds=0)


def test_native_writes_only_under_home_or_tmp_and_up_to_5_mib(fake):
    api = fake.api()
    sandbox = create(api)
    payload = base64.b64encode(b"\x00data").decode()
    written = api.write_file(
        sandbox.id, FileWriteRequest(path="/home/user/d/f.bin", content=payload, encoding="base64")
    )
    assert (written.type, written.size) == ("file.written", 5)
    assert fake.sandboxes[sandbox.id].host_path("/home/user/d/f.bin").read_bytes() == b"\x00data"
    with pytest.raises(BadRequestException) as caught:
        api.write_file(sandbox.id, FileWriteRequest(path="/etc/passwd", content="x"))
    assert "invalid_path" in caught.value.body
    big = base64.b64encode(b"a" * WRITE_BODY_CAP).decode()
    with pytest.raises(ApiException) as caught:
        api.write_file(sandbox.id, FileWriteRequest(path="/tmp/big", content=big, encoding="base64"))
    assert caught.value.status == 413


def test_delete_wants_the_id_repeated_and_is_asynchronous(fake):
    api = fake.api()
    sandbox = create(api)
    with pytest.raises(BadRequestException):
        api.delete_sandbox(x_ascii_confirm_delete="bx_wrongone", sandbox_id=sandbox.id)
    operation = api.delete_sandbox(x_ascii_confirm_delete=sandbox.id, sandbox_id=sandbox.id)
    assert (operation.type, operation.operation.status) == ("sandbox.deleting", "pending")
    assert api.get(sandbox.id).sandbox.state == "archiving"
    fake.finish_deletions()
    with pytest.raises(NotFoundException):
        api.get(sandbox.id)


def test_a_provisioning_sandbox_becomes_ready_after_polls(fake):
    fake.provisioning_polls = 2
    api = fake.api()
    sandbox = create(api)
    assert sandbox.state == "provisioning"
    assert [api.get(sandbox.id).sandbox.state for _ in range(2)] == ["provisioning", "ready"]


@pytest.mark.parametrize("status", [413, 429, 503])
def test_status_failures_with_retry_after_are_raised_not_resent(fake, status):
    api = fake.api()
    sandbox = create(api)
    fake.fail("command", status=status, retry_after="1")
    with pytest.raises(ApiException) as caught:
        run(api, sandbox.id, "echo ran >> runs")
    assert caught.value.status == status and caught.value.headers["Retry-After"] == "1"
    assert isinstance(caught.value, ServiceException) == (status == 503)
    assert fake.count("command") == 1
    assert not fake.sandboxes[sandbox.id].host_path("runs").exists()


def test_a_dropped_response_after_the_command_ran(fake):
    api = fake.api(retries=NO_RETRIES)
    sandbox = create(api)
    fake.fail("command", drop=True)
    with pytest.raises(urllib3.exceptions.HTTPError):
        run(api, sandbox.id, "echo ran >> runs")
    assert fake.count("command") == 1
    assert fake.sandboxes[sandbox.id].host_path("runs").read_text() == "ran\n"


def test_positive_control_default_retries_resend_a_request_never_answered(fake):
    api = fake.api()
    sandbox = create(api)
    fake.fail("get", hang=True, times=10)
    with pytest.raises(urllib3.exceptions.HTTPError):
        api.get(sandbox.id, _request_timeout=0.2)
    assert fake.count("get") == 4  # urllib3's default: three more tries of an idempotent request


def test_without_retries_a_request_never_answered_is_tried_once(fake):
    api = fake.api(retries=NO_RETRIES)
    sandbox = create(api)
    fake.fail("command", hang=True, times=10)
    with pytest.raises(urllib3.exceptions.HTTPError):
        run(api, sandbox.id, "true", _request_timeout=0.2)
    assert fake.count("command") == 1


def test_a_wrong_api_key_is_unauthorized(fake):
    with pytest.raises(ApiException) as caught:
        fake.api(api_key="nope").get("bx_23456789")
    assert caught.value.status == 401
