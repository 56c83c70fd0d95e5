"""The OpenShell gateway double answers the real ``openshell`` SDK as the tests rely on."""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import requires_bwrap

openshell = pytest.importorskip("openshell")

from openshell._proto import datamodel_pb2, openshell_pb2, sandbox_pb2  # noqa: E402
from openshell_gateway import FakeGateway, NoExit, Stall, Unavailable  # noqa: E402

pytestmark = requires_bwrap

NAME = "airflow-0123456789a"


@pytest.fixture
def gateway(tmp_path):
    gateway = FakeGateway(tmp_path / "gateway").start()
    yield gateway
    gateway.stop()


@pytest.fixture
def client(gateway):
    with openshell.SandboxClient(gateway.endpoint, timeout=10) as client:
        yield client


@pytest.fixture
def ready(client):
    client.create(workspace="default", name=NAME, spec=openshell_pb2.SandboxSpec(environment={"GREETING": "hi"}))
    client.wait_ready(NAME, workspace="default", timeout_seconds=30)
    return NAME


def raw_exec(client, command, *, timeout=10, stdin=b""):
    request = openshell_pb2.ExecSandboxRequest(
        workspace_scope=datamodel_pb2.WorkspaceSelector(workspace="default"),
        sandbox=NAME,
        command=command,
        stdin=stdin,
        no_login_shell=True,
    )
    return list(client._stub.ExecSandbox(request, timeout=timeout))


def test_create_polls_through_provisioning_to_ready(client, gateway):
    ref = client.create(workspace="default", name=NAME)
    assert ref.id and ref.phase == openshell_pb2.SANDBOX_PHASE_PROVISIONING
    assert client.wait_ready(NAME, workspace="default", timeout_seconds=30).phase == openshell_pb2.SANDBOX_PHASE_READY


def test_names_over_the_limit_are_refused(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.create(workspace="default", name="airflow-sandbox-0123456789ab")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_exec_really_runs_with_stdin_environment_and_exit_code(client, ready):
    result = client.exec(
        ready, ["/bin/sh", "-c", 'cat; echo "$GREETING"; pwd; exit 7'], workspace="default", stdin=b"in\n"
    )
    assert (result.exit_code, result.stdout) == (7, "in\nhi\n/sandbox\n")


def test_files_persist_between_execs_and_the_network_is_absent(client, ready):
    client.exec(ready, ["/bin/sh", "-c", "echo kept > /sandbox/f; echo tmp > /tmp/t"], workspace="default")
    result = client.exec(
        ready,
        ["/bin/sh", "-c", "cat /sandbox/f /tmp/t; sed -n 's/^ *\\([a-z0-9]*\\):.*/\\1/p' /proc/net/dev"],
        workspace="default",
    )
    assert result.stdout == "kept\ntmp\nlo\n"


def test_stream_is_binary_safe_where_exec_decodes(client, ready):
    command = ["/bin/sh", "-c", r"printf '\000\377'"]
    chunks = [
        item
        for item in client.exec_stream(ready, command, workspace="default")
        if isinstance(item, openshell.ExecChunk)
    ]
    assert b"".join(chunk.data for chunk in chunks) == b"\x00\xff"
    assert client.exec(ready, command, workspace="default").stdout == "\x00\ufffd"


def test_unavailable_mid_stream(client, gateway, ready):
    gateway.exec_faults.append(Unavailable(after=1))
    with pytest.raises(grpc.RpcError) as caught:
        raw_exec(client, ["/bin/sh", "-c", "echo a; sleep 0.2; echo b"])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stall_runs_into_the_client_deadline_and_the_command_is_hung_up(client, gateway, ready):
    gateway.exec_faults.append(Stall(after=1))
    with pytest.raises(grpc.RpcError) as caught:
        raw_exec(client, ["/bin/sh", "-c", "echo a; sleep 300"], timeout=1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    sandbox = gateway.sandbox(ready)
    for _ in range(200):
        if not gateway.processes_of(sandbox):
            break
        time.sleep(0.02)
    assert gateway.processes_of(sandbox) == []


def test_no_exit_event(client, gateway, ready):
    gateway.exec_faults.append(NoExit())
    with pytest.raises(openshell.SandboxError):
        client.exec(ready, ["/bin/sh", "-c", "echo a"], workspace="default")


def test_readback_reports_the_policy_sent_until_it_drifts(client, gateway):
    policy = sandbox_pb2.SandboxPolicy(landlock=sandbox_pb2.LandlockPolicy(compatibility="hard_requirement"))
    client.create(workspace="default", name=NAME, spec=openshell_pb2.SandboxSpec(policy=policy))
    request = sandbox_pb2.GetSandboxConfigRequest(
        workspace_scope=datamodel_pb2.WorkspaceSelector(workspace="default"), name=NAME
    )
    config = client._stub.GetSandboxConfig(request, timeout=5)
    assert config.policy == policy and config.configuration_admitted
    assert config.policy_source == sandbox_pb2.POLICY_SOURCE_SANDBOX
    gateway.drift(NAME, lambda c: c.policy.network_policies["x"].endpoints.add(host="evil.example", port=443))
    assert "x" in client._stub.GetSandboxConfig(request, timeout=5).policy.network_policies


def test_vanish_then_not_found(client, gateway, ready):
    gateway.vanish(ready)
    with pytest.raises(openshell.GatewayError) as caught:
        client.get(ready, workspace="default")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_by_label_and_delete(client, gateway):
    client.create(workspace="default", name="airflow-aaaaaaaaaaa", labels={"managed-by": "airflow"})
    client.create(workspace="default", name="other", labels={"managed-by": "someone"})
    assert [s.name for s in client.list_all(workspace="default", label_selector="managed-by=airflow")] == [
        "airflow-aaaaaaaaaaa"
    ]
    assert client.delete("airflow-aaaaaaaaaaa", workspace="default").outcome == openshell.DeletionOutcome.COMPLETED
    missing = client.delete("airflow-aaaaaaaaaaa", workspace="default", allow_missing=True)
    assert missing.outcome == openshell.DeletionOutcome.ALREADY_ABSENT


def test_bearer_token_is_required_when_set(tmp_path):
    gateway = FakeGateway(tmp_path / "gw", token="s3cret").start()
    try:
        with openshell.SandboxClient(gateway.endpoint, timeout=5) as anonymous:
            with pytest.raises(grpc.RpcError) as caught:
                anonymous.health()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with openshell.SandboxClient(gateway.endpoint, timeout=5, bearer_token="s3cret") as client:
            assert client.health().status == openshell_pb2.SERVICE_STATUS_HEALTHY
    finally:
        gateway.stop()


def test_injected_failure(client, gateway):
    gateway.fail_next("CreateSandbox", grpc.StatusCode.RESOURCE_EXHAUSTED, "quota")
    with pytest.raises(grpc.RpcError) as caught:
        client.create(workspace="default", name=NAME)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
