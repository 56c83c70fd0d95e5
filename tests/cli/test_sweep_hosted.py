"""
The sweep's Python API against each hosted backend's test double (the real SDK against a stand-in)
and the real Kubernetes cluster: a sandbox a task made and left (its worker gone: nothing of it ends
the sandbox) is listed with the Dag, task and try that made it; a dry run changes nothing; a sweep past
its lifetime removes exactly it and leaves held and owned ones; a second sweep finds nothing. Backends
that cannot list say so, and what bounds their leftovers.
"""

from __future__ import annotations

import time
import uuid

import pytest

from conftest import DOCKER_IMAGE
from sandbox_provider.cli import sweep as api
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    MAP_INDEX_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
    SandboxSpec,
)

#: Seconds past every lifetime of these tests (the backends' defaults are an hour or less).
FAR = 2 * 86400


def stamped(monkeypatch) -> str:
    """Make the sandboxes created from here on carry a task's stamps, as a worker's would; return the Dag id."""
    dag_id = f"leftovers_{uuid.uuid4().hex[:8]}"
    stamps = {DAG_ID_TAG: dag_id, RUN_ID_TAG: "killed", TASK_ID_TAG: "t", MAP_INDEX_TAG: "-1", TRY_NUMBER_TAG: "2"}
    monkeypatch.setattr("sandbox_provider.sandbox.hook.trace_stamps", lambda: dict(stamps))
    return dag_id


def check_sweep(hook, monkeypatch, *, spec: SandboxSpec, traced: bool = True) -> None:
    """The scenario of the module docstring on ``hook``; owned and held sandboxes where the backend can attach."""
    dag_id = stamped(monkeypatch)
    scope = dag_id if traced else None
    left = hook.create(spec=spec)
    kept = {}
    if hook.attachable:
        kept["owned"] = hook.create(spec=SandboxSpec(**{**spec.__dict__, "owner": f"{dag_id}/kept"}))
        kept["held"] = hook.create(spec=SandboxSpec(**{**spec.__dict__, "owner": f"{dag_id}/shared"}))
        hook.attach(kept["held"], owner=f"{dag_id}/shared", holder=f"{dag_id}/shared/agent")
    everyone = {left, *kept.values()}
    try:
        listing = api.list_sandboxes([hook], dag_id=scope)
        found = {record.handle: record for _, record in listing.found}
        assert set(found) == everyone and not listing.unlisted, (found, listing.unlisted)
        if traced:
            assert found[left].made_by == {
                "dag_id": dag_id,
                "run_id": "killed",
                "task_id": "t",
                "map_index": "-1",
                "try_number": "2",
            }
        assert found[left].lifetime_left() > 0
        if hook.attachable:
            assert found[kept["held"]].holder == f"{dag_id}/shared/agent"

        assert api.sweep([hook], dag_id=scope).removed == []  # nothing past its lifetime yet
        later = time.time() + FAR
        dry = api.sweep([hook], dag_id=scope, dry_run=True, now=later)
        assert [item.record.handle for item in dry.removed] == [left] and dry.ok, dry.lines()
        assert {item.record.handle for item in dry.kept} == set(kept.values())
        assert {r.handle for _, r in api.list_sandboxes([hook], dag_id=scope).found} == everyone

        swept = api.sweep([hook], dag_id=scope, now=later)
        assert [item.record.handle for item in swept.removed] == [left] and swept.ok, swept.lines()
        assert {r.handle for _, r in api.list_sandboxes([hook], dag_id=scope).found} == set(kept.values())
        again = api.sweep([hook], dag_id=scope, now=later)
        assert again.removed == [] and again.ok
    finally:
        for handle in everyone:
            hook.destroy(handle)


# -- Modal: the real SDK against a gRPC stand-in -------------------------------------------------------------

from modal_server import modal_server_fixture  # noqa: E402, F401  (the stand-in's fixture, "modal_server")


def test_modal(modal_server, monkeypatch):
    from sandbox_provider.hooks.modal import ModalSandboxHook

    check_sweep(ModalSandboxHook(modal_conn_id=None), monkeypatch, spec=SandboxSpec())


# -- OpenSandbox: the real SDK over a mock transport ---------------------------------------------------------


def test_opensandbox(add_connection, monkeypatch):
    import fake_opensandbox

    from sandbox_provider.hooks.opensandbox import OpenSandboxHook

    fake = fake_opensandbox.FakeOpenSandbox()
    try:
        conn = add_connection("sweep_os", "sandbox_opensandbox", host="os.example.invalid", port=8443, password="k")
        hook = OpenSandboxHook(conn, transport=fake.transport, image=DOCKER_IMAGE)
        fake.add(metadata={"team": "not ours"})  # a sandbox another client made: never listed
        check_sweep(hook, monkeypatch, spec=SandboxSpec(block_network=False))
    finally:
        fake.release.set()


# -- OpenShell: the real SDK against an in-process gRPC gateway ----------------------------------------------


def test_openshell(tmp_path, add_connection, monkeypatch):
    from openshell_gateway import FakeGateway

    from sandbox_provider.hooks.openshell import OpenShellSandboxHook

    monkeypatch.setattr(OpenShellSandboxHook, "poll_interval", 0.01)
    gateway = FakeGateway(tmp_path / "gateway").start()
    try:
        host, port = gateway.endpoint.split(":")
        conn = add_connection("sweep_openshell", "sandbox_openshell", host=host, port=int(port))
        hook = OpenShellSandboxHook(conn, relay_grace=1.0, request_timeout=10.0)
        try:
            check_sweep(hook, monkeypatch, spec=SandboxSpec())
        finally:
            hook.close()
    finally:
        gateway.stop()


# -- sbx: a stand-in CLI that runs real containers -----------------------------------------------------------


@pytest.mark.docker
def test_sbx(docker_client, tmp_path, monkeypatch):
    from sbx_fixtures import sbx_standin

    from sandbox_provider.hooks.sbx import SbxSandboxHook

    with sbx_standin(tmp_path / "sbx", DOCKER_IMAGE) as standin:
        hook = SbxSandboxHook(sbx_path=standin.path, memory="1g", cli_grace=2.0, host_network_policy="deny-all")
        # sbx keeps only a sandbox's expiry with it: no task stamps to list or scope by.
        check_sweep(hook, monkeypatch, spec=SandboxSpec(), traced=False)


# -- backends that cannot list --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "bound"),
    [
        ("sandbox_provider.hooks.islo:IsloSandboxHook", "Islo deletes each sandbox at the end of its lifetime"),
        ("sandbox_provider.hooks.boat:BoatSandboxHook", "Boat archives each sandbox at the end of its lifetime"),
    ],
)
def test_a_backend_that_cannot_list_says_what_bounds_its_leftovers(path, bound, add_connection):
    from sandbox_provider.hooks import hook_class

    hook = hook_class(path)("sweep_unlisted")  # no connection is read: nothing is asked of the vendor
    listing = api.list_sandboxes([hook])
    assert listing.found == [] and list(listing.unlisted) == ["sweep_unlisted"]
    (line,) = listing.unlisted.values()
    assert "backend cannot list its sandboxes" in line and bound in line, line
    report = api.sweep([hook])
    assert report.ok and report.unlisted == listing.unlisted


# -- Kubernetes: the real cluster on loopback ----------------------------------------------------------------


def test_kubernetes(kubernetes_conn, monkeypatch):
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    check_sweep(KubernetesSandboxHook(kubernetes_conn), monkeypatch, spec=SandboxSpec())
