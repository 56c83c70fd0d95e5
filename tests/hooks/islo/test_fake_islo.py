"""The Islo stand-in, driven by the real ``islo`` SDK: it must answer what the SDK parses, and fail as asked."""

from __future__ import annotations

import socket
import time
import types

import httpx
import pytest

islo = pytest.importorskip("islo")

from fake_islo import STREAM_CAP, FakeIslo  # noqa: E402
from islo.core.api_error import ApiError  # noqa: E402
from islo.errors import NotFoundError  # noqa: E402

from conftest import requires_bwrap  # noqa: E402

pytestmark = requires_bwrap

NO_RETRY = {"max_retries": 0}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    service = FakeIslo(tmp_path / "islo").install(monkeypatch)
    yield service
    service.close()


@pytest.fixture
def sdk_sleeps(monkeypatch):
    """The SDK's retry pauses, recorded instead of slept."""
    import islo.core.http_client as http_client

    slept: list[float] = []
    monkeypatch.setattr(http_client, "time", types.SimpleNamespace(sleep=slept.append, time=time.time))
    return slept


def wait_result(client, name, exec_id):
    end = time.monotonic() + 60
    while True:
        result = client.sandboxes.get_exec_result(name, exec_id)
        if result.status != "running" or time.monotonic() > end:
            return result
        time.sleep(0.02)


def test_create_exec_and_poll_run_the_command_for_real(fake):
    client = fake.client()
    created = client.sandboxes.create_sandbox(name="sb-one", env={"GREETING": "hi"}, internet_enabled=False)
    assert (created.name, created.status, created.workdir) == ("sb-one", "running", "/workspace")
    started = client.sandboxes.exec_in_sandbox("sb-one", command=["sh", "-c", 'echo "$GREETING" > f; cat f; exit 5'])
    result = wait_result(client, "sb-one", started.exec_id)
    assert (result.status, result.exit_code, result.stdout, result.truncated) == ("completed", 5, "hi\n", False)
    assert (fake.sandboxes["sb-one"].root / "workspace" / "f").read_text() == "hi\n"
    assert fake.sandboxes["sb-one"].request["internet_enabled"] is False
    assert fake.token_exchanges == 1


def test_a_sandbox_without_internet_does_not_reach_the_workers_loopback(fake):
    client = fake.client()
    probe = "import socket; socket.create_connection(('127.0.0.1', {}), timeout=3).close(); print('connected')"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        reached = {}
        for name, internet in (("sb-open", True), ("sb-closed", False)):
            client.sandboxes.create_sandbox(name=name, internet_enabled=internet)
            started = client.sandboxes.exec_in_sandbox(name, command=["python3", "-c", probe.format(port)])
            reached[internet] = wait_result(client, name, started.exec_id).stdout
    assert reached[True] == "connected\n"  # the control: with internet the worker's loopback answers
    assert reached[False] == ""


def test_the_service_overwrites_path(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-path", env={"PATH": "/nowhere"})
    started = client.sandboxes.exec_in_sandbox("sb-path", command=["sh", "-c", 'printf %s "$PATH"'])
    assert wait_result(client, "sb-path", started.exec_id).stdout != "/nowhere"


def test_streams_are_capped_at_one_mebibyte_keeping_the_head(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-big")
    script = "head -c 1200000 /dev/zero | tr '\\0' a; echo; echo end"
    started = client.sandboxes.exec_in_sandbox("sb-big", command=["sh", "-c", script])
    result = wait_result(client, "sb-big", started.exec_id)
    assert result.truncated
    assert len(result.stdout) == STREAM_CAP and "end" not in result.stdout


def test_files_upload_and_stream_back(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-files")
    status = client.sandboxes.upload_file("sb-files", path="/workspace/data.bin", file=("x", b"\x00\x01payload"))
    assert status.status == "uploaded"
    chunks = list(client.sandboxes.download_file("sb-files", path="data.bin", request_options={"chunk_size": 3}))
    assert b"".join(chunks) == b"\x00\x01payload" and len(chunks) > 1
    with pytest.raises(NotFoundError):
        list(client.sandboxes.download_file("sb-files", path="missing"))


def test_deleting_a_missing_sandbox_is_not_found_and_not_retried(fake):
    client = fake.client()
    with pytest.raises(NotFoundError):
        client.sandboxes.delete_sandbox("sb-nothing")
    assert fake.count("delete") == 1


def test_a_wrong_api_key_fails_the_exchange(fake):
    with pytest.raises(httpx.HTTPStatusError):
        fake.client(api_key="ak_wrong").sandboxes.get_sandbox("sb-any")


def test_positive_control_the_sdk_resends_an_exec_after_a_503_and_it_runs_twice(fake, sdk_sleeps):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-twice")
    fake.fail("exec", status=503, after=True, retry_after="1")
    started = client.sandboxes.exec_in_sandbox("sb-twice", command=["sh", "-c", "echo ran >> runs"])
    wait_result(client, "sb-twice", started.exec_id)
    assert fake.count("exec") == 2 and sdk_sleeps == [1.0]
    _wait_all(fake, "sb-twice")
    assert (fake.sandboxes["sb-twice"].root / "workspace" / "runs").read_text() == "ran\nran\n"


def test_positive_control_the_sdk_resends_an_exec_after_a_dropped_response(fake, sdk_sleeps):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-dropped")
    fake.fail("exec", drop=True)
    client.sandboxes.exec_in_sandbox("sb-dropped", command=["sh", "-c", "echo ran >> runs"])
    assert fake.count("exec") == 2 and len(sdk_sleeps) == 1
    _wait_all(fake, "sb-dropped")
    assert (fake.sandboxes["sb-dropped"].root / "workspace" / "runs").read_text() == "ran\nran\n"


def test_without_retries_one_exec_request_is_sent(fake, sdk_sleeps):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-once")
    fake.fail("exec", status=503, after=True)
    with pytest.raises(ApiError) as caught:
        client.sandboxes.exec_in_sandbox("sb-once", command=["true"], request_options=NO_RETRY)
    assert caught.value.status_code == 503
    fake.fail("exec", drop=True)
    with pytest.raises(httpx.RemoteProtocolError):
        client.sandboxes.exec_in_sandbox("sb-once", command=["true"], request_options=NO_RETRY)
    assert fake.count("exec") == 2 and sdk_sleeps == []


def test_a_connection_failure_never_reaches_the_service(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-conn")
    fake.fail("exec", connect=True)
    with pytest.raises(httpx.ConnectError):
        client.sandboxes.exec_in_sandbox("sb-conn", command=["true"], request_options=NO_RETRY)
    assert fake.count("exec") == 0


def test_a_rate_limit_before_the_request_took_effect(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-429")
    fake.fail("exec", status=429, retry_after="3")
    with pytest.raises(ApiError) as caught:
        client.sandboxes.exec_in_sandbox("sb-429", command=["true"], request_options=NO_RETRY)
    assert caught.value.status_code == 429 and caught.value.headers["retry-after"] == "3"
    assert fake.sandboxes["sb-429"].execs == {}


def test_deleting_kills_running_commands(fake):
    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-kill")
    client.sandboxes.exec_in_sandbox("sb-kill", command=["sleep", "30"])
    (record,) = fake.sandboxes["sb-kill"].execs.values()
    client.sandboxes.delete_sandbox("sb-kill")
    assert record.done.wait(60) and record.exit_code == 128 + 9
    assert fake.deleted == ["sb-kill"] and not (fake.root / "sb-kill").exists()


def _wait_all(fake, name):
    for record in fake.sandboxes[name].execs.values():
        assert record.done.wait(60)


def test_activity_resumes_a_paused_sandbox_only_when_its_lifecycle_allows(fake):
    from islo.types import AutoResumePolicy, LifecyclePolicy

    client = fake.client()
    client.sandboxes.create_sandbox(name="sb-on", lifecycle=LifecyclePolicy(auto_resume=AutoResumePolicy.ON_ACTIVITY))
    client.sandboxes.create_sandbox(name="sb-never", lifecycle=LifecyclePolicy(auto_resume=AutoResumePolicy.NEVER))
    for name in ("sb-on", "sb-never"):
        fake.sandboxes[name].status = "paused"
    client.sandboxes.exec_in_sandbox("sb-on", command=["true"], request_options=NO_RETRY)
    assert fake.sandboxes["sb-on"].status == "running"
    with pytest.raises(ApiError) as caught:
        client.sandboxes.exec_in_sandbox("sb-never", command=["true"], request_options=NO_RETRY)
    assert caught.value.status_code == 409 and fake.sandboxes["sb-never"].status == "paused"
