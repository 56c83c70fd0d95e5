"""The local backend's defaults: the sandbox_local_default connection, and a state root per Airflow instance."""

from __future__ import annotations

import os
import tempfile

import pytest

from sandbox_provider.hooks import get_sandbox_hook
from sandbox_provider.hooks.local.hook import LocalSandboxHook, default_state_root


def test_the_default_connection_is_read_when_it_exists(add_connection, tmp_path):
    add_connection(
        "sandbox_local_default", "sandbox_local", extra={"state_root": str(tmp_path / "s"), "max_processes": 77}
    )
    hook = LocalSandboxHook()
    assert hook.state_root == str(tmp_path / "s")
    assert hook._resolved()["max_processes"] == 77
    assert LocalSandboxHook(max_processes=5)._resolved()["max_processes"] == 5  # an argument still wins
    assert get_sandbox_hook(None).state_root == str(tmp_path / "s")  # backend=None is the same hook


def test_without_the_default_connection_the_defaults_apply(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_SANDBOX_LOCAL_DEFAULT", raising=False)
    hook = LocalSandboxHook()
    assert hook.state_root == default_state_root()
    assert hook._resolved()["max_processes"] == 1024


def test_a_named_connection_must_exist():
    from airflow.exceptions import AirflowNotFoundException

    with pytest.raises(AirflowNotFoundException):
        _ = LocalSandboxHook("no_such_connection_here").state_root


def test_a_default_connection_of_another_type_is_refused(add_connection):
    from sandbox_provider.sandbox import SandboxTerminalError

    add_connection("sandbox_local_default", "sandbox_docker")
    with pytest.raises(SandboxTerminalError, match="'sandbox_local_default' has type 'sandbox_docker'"):
        _ = LocalSandboxHook().state_root


def test_the_state_root_is_one_per_airflow_instance_and_user(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "one"))
    first = default_state_root()
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "two"))
    second = default_state_root()
    assert first != second
    os.symlink(tmp_path / "one", tmp_path / "link")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "link"))
    assert default_state_root() == first  # the same instance however its home is spelled
    assert os.path.dirname(first) == tempfile.gettempdir()
    assert os.path.basename(first).startswith(f"airflow-sandbox-{os.getuid()}-")


def test_a_missing_default_connection_is_asked_for_once_per_worker_process(
    monkeypatch, add_connection, connection_lookups, tmp_path
):
    """
    A task's hooks ask for sandbox_local_default once (each ask is a round trip to the supervisor),
    its settings and its log policy alike.
    """
    from sandbox_provider.engine.task_log import log_policy

    monkeypatch.delenv("AIRFLOW_CONN_SANDBOX_LOCAL_DEFAULT", raising=False)
    asked = connection_lookups
    for _ in range(3):
        assert LocalSandboxHook().state_root == default_state_root()
        assert log_policy({}, LocalSandboxHook(), None).mode == "all"
    assert asked == ["sandbox_local_default"]
    # One defined in the environment meanwhile is still found.
    add_connection("sandbox_local_default", "sandbox_local", extra={"state_root": str(tmp_path / "s")})
    assert LocalSandboxHook().state_root == str(tmp_path / "s")
