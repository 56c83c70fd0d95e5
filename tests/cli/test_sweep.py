"""
``airflow sandboxes`` and its Python API against real local and Docker sandboxes: a worker SIGKILLed in
the middle of a command (a real supervisor and task process, ``tests/task_process.py``) leaves its
sandbox; the listing names the Dag, task and try that made it; a dry run changes nothing; a sweep
removes exactly the expired ones and leaves held and owned ones; a second sweep finds nothing. The CLI
runs in a real ``airflow`` process (several commands in one: ``cli_batch.py``) on the instance's own
metadata database, whose task instance states ``--orphans`` reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import cli_batch
import task_process
from conftest import DOCKER_IMAGE, requires_bwrap
from sandbox_provider.cli import sweep as api
from sandbox_provider.hooks import get_sandbox_hook
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    MAP_INDEX_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
    SandboxSpec,
)

HARNESS = Path(__file__).parents[1] / "task_process.py"
#: Seconds a step may take on a loaded machine before the test gives up (a bound, not an assertion).
PATIENCE = 120
#: The lifetime of the sandboxes that expire in these tests, in seconds; judged at ``now + LATER``.
SHORT, LATER, LONG = 60, 120, 3600

DAG = """
import os

from airflow.sdk import DAG
from sandbox_provider.operators.sandbox import SandboxOperator

with DAG(os.environ["TEST_DAG_ID"], schedule=None):
    SandboxOperator(task_id="t", backend=os.environ["TEST_CONN"], command="echo started; sleep 600", timeout=600)
"""


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    """An Airflow instance of its own: home, migrated SQLite database, Dag folder and log folder."""
    root = tmp_path_factory.mktemp("instance")
    env = task_process.instance(root)
    (root / "dags" / "leftovers.py").write_text(textwrap.dedent(DAG))
    return root, env


def _conn(kind: str, root: Path, lifetime: int) -> dict:
    if kind == "local":
        return {"conn_type": "sandbox_local", "extra": {"state_root": str(root / "state"), "sandbox_timeout": lifetime}}
    extra = {"image": DOCKER_IMAGE, "cpus": 1, "memory_bytes": 256 * 1024 * 1024, "sandbox_timeout": lifetime}
    return {"conn_type": "sandbox_docker", "extra": extra}


@pytest.fixture(params=[pytest.param("local", marks=requires_bwrap), pytest.param("docker", marks=pytest.mark.docker)])
def place(request, instance, monkeypatch):
    """
    ``(conn_id, env, dag_id)``: a connection of the backend, in this process and the instance's, whose
    sandboxes live :data:`SHORT` seconds, or :data:`LONG` for a test marked ``long_lived``.
    """
    if request.param == "docker":
        request.getfixturevalue("docker_client")
    root, base = instance
    conn_id = f"sweep_{request.param}"
    lifetime = LONG if request.node.get_closest_marker("long_lived") else SHORT
    value = json.dumps(_conn(request.param, root, lifetime))
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", value)
    dag_id = f"leftovers_{request.param}_{uuid.uuid4().hex[:8]}"  # its own: other tests share the Engine
    env = {**base, f"AIRFLOW_CONN_{conn_id.upper()}": value, "TEST_CONN": conn_id, "TEST_DAG_ID": dag_id}
    return conn_id, env, dag_id


def _events(log: Path) -> list[str]:
    found = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        try:
            found.append(str(json.loads(line).get("event", "")))
        except ValueError:
            continue
    return found


def killed_worker(instance, env: dict, dag_id: str, run_id: str) -> str:
    """Run try 1 of ``<dag_id>.t``, SIGKILL its task process in the middle of the command; the sandbox's handle."""
    root, _ = instance
    log = root / "logs" / dag_id / run_id / "1.log"  # the Dag id is the test's own: no earlier log or pid file
    supervisor = subprocess.Popen(
        [sys.executable, str(HARNESS), str(root / "dags" / "leftovers.py"), dag_id, "t", run_id, "1"]
        + [os.path.relpath(log, root / "logs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    handle = None
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline and supervisor.poll() is None:
        events = _events(log)
        handle = next((e.split()[2] for e in events if e.startswith("Provisioned sandbox airflow-sandbox-")), None)
        if handle and "[stdout] started" in events:
            break
        time.sleep(0.1)
    else:
        out = supervisor.communicate(timeout=PATIENCE)[0] if supervisor.poll() is not None else b""
        pytest.fail(f"the command never started; log: {_events(log)}; output: {out.decode(errors='replace')[-2000:]}")
    os.kill(int(Path(str(log) + ".pid").read_text()), signal.SIGKILL)
    supervisor.wait(timeout=PATIENCE)
    assert handle
    return handle


def test_a_sweep_removes_exactly_the_expired_leftovers(instance, place, monkeypatch):
    conn_id, env, dag_id = place
    left = killed_worker(instance, env, dag_id, "killed")
    hook = get_sandbox_hook(conn_id)
    # Sandboxes made outside a task carry no task stamps; these carry the test's, to be found by Dag.
    stamps = {DAG_ID_TAG: dag_id, RUN_ID_TAG: "manual", TASK_ID_TAG: "test", MAP_INDEX_TAG: "-1", TRY_NUMBER_TAG: "1"}
    monkeypatch.setattr("sandbox_provider.sandbox.hook.trace_stamps", lambda: dict(stamps))
    owned = hook.create(spec=SandboxSpec(owner=f"{dag_id}/kept"))
    held = hook.create(spec=SandboxSpec(owner=f"{dag_id}/shared"))
    hook.attach(held, owner=f"{dag_id}/shared", holder=f"{dag_id}/shared/agent")
    fresh = type(hook)(conn_id, sandbox_timeout=LONG).create()
    everyone = {left, owned, held, fresh}
    try:
        listing = api.list_sandboxes([conn_id], dag_id=dag_id)
        found = {record.handle: record for _, record in listing.found}
        assert set(found) == everyone, found
        assert found[left].made_by == {
            "dag_id": dag_id,
            "run_id": "killed",
            "task_id": "t",
            "map_index": "-1",
            "try_number": "1",
        }
        assert found[held].holder == f"{dag_id}/shared/agent" and found[owned].owner == f"{dag_id}/kept"
        assert not listing.unlisted
        later = time.time() + LATER
        # Nothing is past its lifetime yet: a sweep now finds nothing (a positive control for the rules below).
        assert api.sweep([conn_id], dag_id=dag_id).removed == []

        dry = api.sweep([conn_id], dag_id=dag_id, dry_run=True, now=later)
        assert [item.record.handle for item in dry.removed] == [left] and dry.ok
        assert {item.record.handle for item in dry.kept} == {owned, held}
        assert {r.handle for _, r in api.list_sandboxes([conn_id], dag_id=dag_id).found} == everyone  # unchanged

        swept = api.sweep([conn_id], dag_id=dag_id, now=later)
        assert [item.record.handle for item in swept.removed] == [left] and swept.ok, swept.lines()
        assert {r.handle for _, r in api.list_sandboxes([conn_id], dag_id=dag_id).found} == {owned, held, fresh}
        again = api.sweep([conn_id], dag_id=dag_id, now=later)
        assert again.removed == [] and again.ok

        # Owned ones go with include_owned; the held one still stays until forced.
        owned_too = api.sweep([conn_id], dag_id=dag_id, now=later, include_owned=True)
        assert [item.record.handle for item in owned_too.removed] == [owned]
        forced = api.sweep([conn_id], dag_id=dag_id, now=later, include_owned=True, force=True)
        assert [item.record.handle for item in forced.removed] == [held]
        assert {r.handle for _, r in api.list_sandboxes([conn_id], dag_id=dag_id).found} == {fresh}
    finally:
        for handle in everyone:
            hook.destroy(handle)


@pytest.mark.long_lived  # the airflow commands take seconds each: it must not expire meanwhile
def test_the_cli_lists_and_sweeps_a_killed_workers_orphan(instance, place):
    conn_id, env, dag_id = place
    left = killed_worker(instance, env, dag_id, "orphan")
    hook = get_sandbox_hook(conn_id)
    where = ["--conn-id", conn_id, "--dag-id", dag_id]
    try:
        # One airflow process runs them in turn (cli_batch.py): not past its lifetime, the orphan stays
        # through a plain sweep and a dry run; --orphans reads its task instance's state (failed) from the
        # database and removes it; a second sweep finds nothing.
        listed, table, shown, plain, dry, after_dry, swept, again = cli_batch.run(
            env,
            ["sandboxes", "list", *where, "--output", "json"],
            ["sandboxes", "list", *where],
            ["sandboxes", "show", left, "--conn-id", conn_id, "--output", "json"],
            ["sandboxes", "sweep", *where],
            ["sandboxes", "sweep", *where, "--orphans", "--dry-run"],
            ["sandboxes", "list", *where, "--output", "json"],
            ["sandboxes", "sweep", *where, "--orphans"],
            ["sandboxes", "sweep", *where, "--orphans"],
            timeout=PATIENCE,
        )
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)["sandboxes"]
        assert [(r["handle"], r["dag_id"], r["task_id"], r["try_number"]) for r in rows] == [(left, dag_id, "t", "1")]
        assert 0 < rows[0]["lifetime_left_seconds"] <= LONG
        assert table.returncode == 0 and left in table.stdout, table.stdout + table.stderr
        assert shown.returncode == 0 and json.loads(shown.stdout)["stamps"][TASK_ID_TAG] == "t", shown.stderr

        assert plain.returncode == 0 and "Removed 0 sandboxes" in plain.stdout, plain.stdout + plain.stderr
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert f"would remove {api.Target(conn_id, hook).backend} sandbox {left}" in dry.stdout, dry.stdout
        assert "the task instance that made it is failed" in dry.stdout, dry.stdout
        assert after_dry.returncode == 0 and [r["handle"] for r in json.loads(after_dry.stdout)["sandboxes"]] == [left]

        assert swept.returncode == 0 and "Removed 1 sandbox," in swept.stdout, swept.stdout + swept.stderr
        assert api.list_sandboxes([conn_id], dag_id=dag_id).found == []
        assert again.returncode == 0 and "Removed 0 sandboxes" in again.stdout, again.stdout
    finally:
        hook.destroy(left)


def test_destroy_needs_force_for_a_held_sandbox(instance, place):
    conn_id, env, dag_id = place
    hook = get_sandbox_hook(conn_id)
    handle = hook.create(spec=SandboxSpec(owner=f"{dag_id}/shared"))
    try:
        hook.attach(handle, owner=f"{dag_id}/shared", holder=f"{dag_id}/shared/agent")
        refused, done = cli_batch.run(
            env,
            ["sandboxes", "destroy", handle, "--conn-id", conn_id],
            ["sandboxes", "destroy", handle, "--conn-id", conn_id, "--force"],
            timeout=PATIENCE,
        )
        assert refused.returncode == 1 and f"held by {dag_id}/shared/agent" in refused.stderr, refused.stderr
        assert done.returncode == 0, done.stderr
        assert api.list_sandboxes([conn_id], dag_id=dag_id).found == []
    finally:
        hook.destroy(handle)


def test_sweep_partials_and_bad_input(instance, tmp_path):
    _, env = instance
    (tmp_path / "out.csv.airflow-0123456789ab-1.partial").write_bytes(b"x")
    (tmp_path / "out.csv").write_bytes(b"kept")
    bad, unknown, partials = cli_batch.run(
        env,
        ["sandboxes", "sweep", "--conn-id", "no_such_connection"],
        ["sandboxes", "list", "--backend", "nope"],
        ["sandboxes", "sweep-partials", tmp_path.as_uri() + "/", "--older-than", "0"],
        timeout=PATIENCE,
    )
    assert bad.returncode != 0 and "no_such_connection" in bad.stdout + bad.stderr, bad
    assert unknown.returncode == 1 and "Unknown backend 'nope'" in unknown.stderr, unknown.stderr
    assert partials.returncode == 0, partials.stderr
    assert "Removed 1 partial file." in partials.stdout, partials.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


@requires_bwrap
def test_by_default_every_sandbox_connection_is_looked_through(tmp_path, add_connection, monkeypatch):
    import sandbox_provider.hooks as hooks

    conn_id = add_connection("sweep_default_local", "sandbox_local", extra={"state_root": str(tmp_path / "s")})
    add_connection("sweep_default_broken", "sandbox_docker")
    add_connection("not_a_sandbox", "http", host="example.invalid")
    real = hooks.get_sandbox_hook

    def get_sandbox_hook(backend):
        if backend == "sweep_default_broken":
            raise ValueError("its secrets backend did not answer")
        return real(backend)

    monkeypatch.setattr(hooks, "get_sandbox_hook", get_sandbox_hook)
    names = [target.name for target in api.targets()]
    assert api.LOCAL_DEFAULTS in names and conn_id in names
    assert "not_a_sandbox" not in names and "sweep_default_broken" not in names
    hook = get_sandbox_hook(conn_id)
    handle = hook.create()
    try:
        listing = api.list_sandboxes(backend="local")
        assert (conn_id, handle) in [(target.name, record.handle) for target, record in listing.found]
        assert "its secrets backend did not answer" in listing.unlisted["sweep_default_broken"]
        assert api.sweep(backend="local", dry_run=True).unlisted == listing.unlisted  # the defaults: look only
    finally:
        hook.destroy(handle)
