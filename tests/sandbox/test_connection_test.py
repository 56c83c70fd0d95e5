"""Connection-test messages name the connection a person tested and the process that ran the test."""

from __future__ import annotations

import inspect
import os
import socket
from types import SimpleNamespace

import pytest

from sandbox_provider.hooks.docker import DockerSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.connection_test import connection_test_origin
from sandbox_provider.sandbox.hook import Capabilities

NOWHERE = "unix:///nonexistent/airflow-sandbox-test/docker.sock"


def _as_the_api_route_does(transient_conn_id, test_body, call):
    """Stands in for Airflow's test route: its locals hold the temporary id and the request."""
    return call()


def test_the_api_servers_temporary_copy_is_named_by_the_tested_id():
    body = SimpleNamespace(connection_id="my_sandbox")
    origin = _as_the_api_route_does("Xk3Pq9Ab", body, lambda: connection_test_origin("Xk3Pq9Ab"))
    assert origin.tested_id == "my_sandbox"
    assert origin.runner == f"the API server (pid {os.getpid()} on host {socket.gethostname()})"
    assert origin.name_tested("Connection 'Xk3Pq9Ab' has a bad 'cpus' extra") == (
        "Connection 'my_sandbox' has a bad 'cpus' extra"
    )


def test_a_route_testing_another_id_is_not_taken_for_this_test():
    body = SimpleNamespace(connection_id="someone_else")
    origin = _as_the_api_route_does("Zz9Zz9Zz", body, lambda: connection_test_origin("sandbox_docker_default"))
    assert origin.tested_id == "sandbox_docker_default"
    assert not origin.runner.startswith("the API server")


def test_outside_the_api_server_the_id_is_as_given_and_the_program_is_named(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/opt/venv/bin/airflow", "connections", "test", "my_sandbox"])
    origin = connection_test_origin("my_sandbox")
    assert origin.tested_id == "my_sandbox"
    assert origin.runner.startswith("airflow connections test (pid ")
    assert origin.name_tested("Connection 'my_sandbox' works") == "Connection 'my_sandbox' works"


def test_hook_message_names_the_tested_connection_and_the_runner(add_connection):
    conn_id = add_connection("Tmp4Id7x", "sandbox_docker", host=NOWHERE)
    body = SimpleNamespace(connection_id="team_docker")
    ok, message = _as_the_api_route_does(conn_id, body, DockerSandboxHook(conn_id).test_connection)
    assert not ok
    assert message.startswith("Connection 'team_docker', tested by the API server (pid ")
    assert "Tmp4Id7x" not in message and NOWHERE in message
    assert "worker" not in message


@pytest.mark.parametrize("blocks", [True, False], ids=["can-block", "cannot-block"])
def test_the_connection_test_asks_for_no_network_only_where_the_backend_can_block_it(tmp_path, monkeypatch, blocks):
    from fake_hook import FakeSandboxHook

    hook = FakeSandboxHook(str(tmp_path), capabilities=Capabilities(no_network=blocks))
    asked: list[SandboxSpec] = []
    check = hook.check_spec
    monkeypatch.setattr(hook, "check_spec", lambda spec: asked.append(spec) or check(spec))
    ok, message = hook.test_connection()
    assert ok, message
    assert [spec.block_network for spec in asked] == [blocks]


def test_airflows_own_test_route_reports_the_tested_id(migrated_airflow_db, monkeypatch):
    """The installed Airflow's route itself (3.2 or 3.3), called as the UI's Test button calls it."""
    from airflow.api_fastapi.core_api.datamodels.connections import ConnectionBody
    from airflow.api_fastapi.core_api.routes.public import connections as routes

    monkeypatch.setenv("AIRFLOW__CORE__TEST_CONNECTION", "Enabled")
    body = ConnectionBody(connection_id="ui_docker", conn_type="sandbox_docker", host=NOWHERE)
    params = inspect.signature(routes.test_connection).parameters
    deny_reads = SimpleNamespace(is_authorized_connection=lambda **kwargs: False)
    extra = {"user": None, "auth_manager": deny_reads}
    response = routes.test_connection(body, **{name: extra[name] for name in params if name in extra})
    assert response.status is False
    assert response.message.startswith("Connection 'ui_docker', tested by the API server (pid "), response.message
    assert NOWHERE in response.message


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["/usr/bin/airflow", "api-server", "-p", "8080"], "airflow api-server"),
        (
            ["/venv/lib/python3.12/site-packages/airflow/__main__.py", "connections", "test", "x"],
            "airflow connections test",
        ),
        (["/venv/lib/python3.12/site-packages/pytest/__main__.py", "-q"], "pytest"),
        (["-c"], "this process"),
    ],
)
def test_program_names_the_airflow_command(monkeypatch, argv, expected):
    monkeypatch.setattr("sys.argv", argv)
    assert connection_test_origin(None).runner.startswith(f"{expected} (pid ")
