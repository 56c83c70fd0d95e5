"""file:// inputs: symlinks are followed, as the worker reads them; [sandbox] file_input_dirs confines them."""

from __future__ import annotations

import os

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.engine import storage
from sandbox_provider.sandbox import SandboxSession, SandboxTerminalError


@pytest.fixture
def hook(tmp_path):
    made = FakeSandboxHook(str(tmp_path / "fake"))
    made.provisioned = []
    real = made._provision
    made._provision = lambda request: made.provisioned.append(request.name) or real(request)
    return made


@pytest.fixture
def tree(tmp_path):
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "data.csv").write_text("inside\n")
    (outside / "secret.txt").write_text("outside\n")
    os.symlink(outside / "secret.txt", allowed / "leads-out")
    os.symlink(allowed / "data.csv", outside / "leads-in")
    return allowed, outside


def staged(hook, url):
    with SandboxSession(hook, inputs={"in": url}) as session:
        return session.run("cat in", timeout=30, max_output_bytes=1000).stdout


def test_without_the_setting_symlinks_are_followed(hook, tree):
    allowed, _ = tree
    assert staged(hook, (allowed / "leads-out").as_uri()) == "outside\n"


def test_the_setting_allows_what_lies_inside(hook, tree, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", f"{allowed}, /nonexistent/too")
    assert staged(hook, (allowed / "data.csv").as_uri()) == "inside\n"
    assert staged(hook, (outside / "leads-in").as_uri()) == "inside\n"  # the file it reads lies inside


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("outside/secret.txt", r"outside the directories this worker stages files from \(\[sandbox\] file_input_dirs"),
        ("allowed/leads-out", r"allowed/leads-out \(which leads to .*outside/secret.txt\), outside the directories"),
        ("allowed/../outside/secret.txt", "outside the directories"),
    ],
)
def test_the_setting_refuses_what_lies_outside_before_provisioning(hook, tree, tmp_path, monkeypatch, name, message):
    allowed, _ = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", str(allowed))
    with pytest.raises(SandboxTerminalError, match=message):
        staged(hook, f"file://{tmp_path}/{name}")
    assert hook.provisioned == []


def test_a_relative_directory_in_the_setting_is_a_clear_error(hook, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", "data/incoming")
    with pytest.raises(SandboxTerminalError, match=r"absolute directories.*\['data/incoming'\]"):
        staged(hook, (allowed / "data.csv").as_uri())
    assert hook.provisioned == []


def test_the_setting_is_read_from_airflow_configuration(monkeypatch, tree):
    allowed, _ = tree
    monkeypatch.delenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", raising=False)
    from airflow.sdk.configuration import conf

    monkeypatch.setattr(
        conf, "get", lambda section, key, fallback=None: str(allowed) if section == "sandbox" else fallback
    )
    assert storage.file_input_dirs() == [str(allowed)]


def test_a_link_swapped_after_the_check_is_caught_on_the_open_file(tree, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv("AIRFLOW__SANDBOX__FILE_INPUT_DIRS", str(allowed))
    real = storage.resolve_file_input

    def checked_then_swapped(local, url, what):
        real(local, url, what)  # passes: inside the allowed directory
        return str(outside / "secret.txt")  # ...but by the time it is opened it leads outside

    monkeypatch.setattr(storage, "resolve_file_input", checked_then_swapped)
    with pytest.raises(SandboxTerminalError, match="changed while it was opened and now leads to .*secret.txt"):
        storage.open_file_input(str(allowed / "data.csv"), "file:///x", "inputs['in']")


def test_the_option_is_declared_to_airflow():
    from sandbox_provider.get_provider_info import get_provider_info

    option = get_provider_info()["config"]["sandbox"]["options"]["file_input_dirs"]
    assert option["default"] == "" and "symlink" in option["description"]
