"""A new try ends the sandboxes earlier tries of the same task instance left running (issue 11, item 4)."""

from __future__ import annotations

import logging
from unittest import mock

import pytest

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox import SandboxSession
from sandbox_provider.sandbox.spec import OWNER_TAG


def context(try_number, map_index=-1, task_id="t"):
    ti = mock.MagicMock(dag_id="d", run_id="r", task_id=task_id, map_index=map_index, try_number=try_number)
    return {"ti": ti}


def left_by(hook, try_number, **overrides):
    """A sandbox as a killed try left it: standing, stamped with its task instance and try."""
    handle = hook.create()
    hook.stamps[handle].update(
        {
            "airflow_dag_id": "d",
            "airflow_run_id": "r",
            "airflow_task_id": "t",
            "airflow_map_index": "-1",
            "airflow_try_number": str(try_number),
            **overrides,
        }
    )
    return handle


@pytest.fixture
def hook(tmp_path):
    return FakeSandboxHook(str(tmp_path))


def test_earlier_tries_are_ended_before_provisioning(hook, caplog):
    first, second = left_by(hook, 1), left_by(hook, 2)
    caplog.set_level(logging.INFO, logger="sandbox_provider")
    with SandboxSession(hook, context=context(3)) as session:
        session.run("true", timeout=10, max_output_bytes=100)
        ends = [c for c in hook.calls if c[0] in ("destroy", "provision")]
        assert ends[-3:-1] == [("destroy", first), ("destroy", second)] and ends[-1][0] == "provision"
    assert f"Ended sandbox {first} on backend fake, which try 1 of this task left running" in caplog.text
    assert f"Ended sandbox {second} on backend fake, which try 2 of this task left running" in caplog.text


def test_other_task_instances_and_shared_sandboxes_are_left_alone(hook, caplog):
    mapped = left_by(hook, 1, airflow_map_index="0")
    other_task = left_by(hook, 1, airflow_task_id="u")
    shared = left_by(hook, 1, **{OWNER_TAG: "d/r"})
    later = left_by(hook, 5)  # a try number above ours: not an earlier try
    caplog.set_level(logging.INFO, logger="sandbox_provider")
    with SandboxSession(hook, context=context(2)) as session:
        session.ensure()
    assert {mapped, other_task, shared, later} <= set(hook.stamps)
    assert f"Leaving sandbox {shared} of try 1 as it is: it carries owner 'd/r'" in caplog.text
    assert "no earlier try of this task left a sandbox running on backend fake" in caplog.text


def test_the_first_try_does_not_look(hook):
    left = left_by(hook, 1)
    with mock.patch.object(hook, "find_sandboxes", side_effect=AssertionError("looked")):
        with SandboxSession(hook, context=context(1)) as session:
            session.ensure()
    assert left in hook.stamps


def test_an_attaching_task_never_ends_anything(hook):
    shared = left_by(hook, 1, **{OWNER_TAG: "d/r"})
    with mock.patch.object(hook, "find_sandboxes", side_effect=AssertionError("looked")):
        with SandboxSession(hook, attach_to=shared, owner="d/r", holder="d/r/t", context=context(2)) as session:
            session.run("true", timeout=10, max_output_bytes=100)
    assert shared in hook.stamps


def test_a_backend_that_cannot_look_says_so(hook, caplog):
    caplog.set_level(logging.INFO, logger="sandbox_provider")
    with mock.patch.object(FakeSandboxHook, "find_sandboxes", side_effect=NotImplementedError):
        with SandboxSession(hook, context=context(2)) as session:
            session.ensure()
    assert "the fake backend cannot look for sandboxes earlier tries left running" in caplog.text


def test_a_failed_search_does_not_stop_the_task(hook, caplog):
    with mock.patch.object(hook, "find_sandboxes", side_effect=RuntimeError("engine down")):
        with SandboxSession(hook, context=context(2)) as session:
            assert session.run("echo ok", timeout=10, max_output_bytes=100).stdout == "ok\n"
    assert "Could not look for sandboxes earlier tries" in caplog.text


def test_the_default_backend_method_says_it_cannot_look(tmp_path):
    from sandbox_provider.sandbox.hook import SandboxHook

    with pytest.raises(NotImplementedError, match="cannot look for sandboxes by their stamps"):
        SandboxHook.find_sandboxes(FakeSandboxHook(str(tmp_path)), {"airflow_dag_id": "d"})


STAMPED = {
    "airflow_dag_id": "d",
    "airflow_run_id": "manual__2025-01-01T00:00:00+00:00",
    "airflow_task_id": "t",
    "airflow_map_index": "-1",
}


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("local", marks=requires_bwrap),
        pytest.param("docker", marks=pytest.mark.docker),
    ],
)
def test_real_backends_find_their_sandboxes_by_stamps(request, tmp_path, backend):
    if backend == "local":
        from sandbox_provider.hooks.local import LocalSandboxHook

        real = LocalSandboxHook(state_root=str(tmp_path / "state"))
    else:
        from sandbox_provider.hooks.docker import DockerSandboxHook

        real = DockerSandboxHook(request.getfixturevalue("docker_conn"), pull="never")
    made = []
    try:
        for try_number, task in (("1", "t"), ("2", "t"), ("1", "other")):
            stamps = {**STAMPED, "airflow_task_id": task, "airflow_try_number": try_number}
            with mock.patch("sandbox_provider.sandbox.hook.trace_stamps", return_value=stamps):
                made.append(real.create())
        found = real.find_sandboxes(STAMPED)
        assert set(found) == set(made[:2])
        assert {found[h]["airflow_try_number"] for h in made[:2]} == {"1", "2"}
        assert real.find_sandboxes({**STAMPED, "airflow_try_number": "2"}).keys() == {made[1]}
    finally:
        for handle in made:
            real.destroy(handle)
    assert real.find_sandboxes(STAMPED) == {}
