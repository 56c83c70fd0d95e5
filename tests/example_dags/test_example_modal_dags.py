"""
The Modal example Dags run end to end under dag.test(), against the fake ``modal`` of ``fake_modal.py``.

The fake runs each sandbox command through the host's ``sh``. The examples work in Modal's default
``/workspace``, so every sandbox here gets its own root under ``tmp_path`` and its ``/workspace`` paths
(in file calls, in the working directory and in command lines) are moved under that root: nothing is
written to the host's ``/workspace``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import fake_modal
import pytest

from dag_runs import task_states

MODAL_FILE = "example_sandbox_modal.py"
GUEST_WORKDIR = "/workspace"
TOKEN = ("ak-example-token", "as-example-secret")
_GUEST_PATH = re.compile(r"(?<![\w./-])/workspace(?=/|$|[^\w.-])")

ORDERS = {  # the ORDERS table of the example, recomputed by hand
    "by_country": {"DE": 950.50, "JP": 2400.00, "US": 1425.24},
    "top_customers": [["Umbrella", 2400.00], ["Acme Corp", 1325.25], ["Globex", 950.50]],
}


def _rooted_sandbox_class(roots: Path) -> type:
    """A FakeSandbox whose ``/workspace`` lives in ``roots/<sandbox id>/workspace`` on the host."""

    class RootedFilesystem(fake_modal.FakeFilesystem):
        def list_files(self, remote_path: str):
            return super().list_files(self._sandbox.host_path(remote_path))

    class RootedSandbox(fake_modal.FakeSandbox):
        def __init__(self, modal, object_id, kwargs) -> None:
            super().__init__(modal, object_id, kwargs)
            self.root = roots / object_id
            self.root.mkdir(parents=True)
            os.makedirs(self.host_path(kwargs.get("workdir") or GUEST_WORKDIR))
            self._filesystem = RootedFilesystem(self)

        def host_path(self, text: str) -> str:
            return _GUEST_PATH.sub(lambda _: str(self.root) + GUEST_WORKDIR, text)

        def put(self, remote_path: str, data: bytes) -> None:
            super().put(self.host_path(remote_path), data)

        def exec(self, *args: str, workdir: str | None = None, **kw):
            args = tuple(self.host_path(arg) for arg in args)
            return super().exec(*args, workdir=workdir and self.host_path(workdir), **kw)

    return RootedSandbox


@pytest.fixture
def fake(monkeypatch, tmp_path, add_connection):
    """A fresh fake ``modal`` for the hook and for ModalHook, running commands on the host; credentials in modal_default."""
    monkeypatch.setattr(fake_modal, "FakeSandbox", _rooted_sandbox_class(tmp_path / "sandboxes"))
    mod = fake_modal.build()
    mod.Sandbox.run_on_host = True
    monkeypatch.setitem(sys.modules, "modal", mod)
    monkeypatch.setitem(sys.modules, "modal.exception", mod.exception)
    provider = importlib.import_module("airflow.providers.modal.hooks.modal")
    monkeypatch.setattr(provider, "modal", mod)
    add_connection("modal_default", "modal", login=TOKEN[0], password=TOKEN[1])
    # The guest scripts call python / python3: make those this interpreter, not whatever PATH finds first.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return mod


def run_modal_example(dag_id: str, **run_conf):
    """Run one Dag of the Modal example file with dag.test(); return the DagRun and a task's XCom reader."""
    import dag_runs

    dag = dag_runs.load_bag(dag_runs.EXAMPLE_DIR / MODAL_FILE).dags[dag_id]
    dag_run = dag.test(run_conf=run_conf or None)

    def xcom(task_id: str):
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        with create_session() as session:
            rows = session.scalars(
                XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_id, task_ids=task_id, key="return_value")
            ).all()
            return XComModel.deserialize_value(rows[0]) if rows else None

    return dag_run, xcom


def calls_named(sandbox, name: str) -> list:
    return [call for call in sandbox.calls if call[0] == name]


def assert_nothing_left_running(fake) -> None:
    assert all(sandbox.terminated for sandbox in fake.Sandbox.by_id.values())
    assert list(fake.Sandbox.list()) == []
    for sandbox in fake.Sandbox.by_id.values():
        (terminate,) = calls_named(sandbox, "terminate")
        assert sandbox.calls[-1] == terminate, "a call was made on the sandbox after it was terminated"


def test_modal_artifact_example_writes_the_summary(migrated_airflow_db, fake, tmp_path):
    dag_run, xcom = run_modal_example("example_sandbox_modal_artifact", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)
    assert task_states(dag_run) == {"summarise": "success"}

    url = f"{tmp_path.as_uri()}/{dag_run.run_id}/summary.json"
    assert xcom("summarise") == url
    summary = json.loads((tmp_path / dag_run.run_id / "summary.json").read_text(encoding="utf-8"))
    assert summary["revenue_by_country"] == pytest.approx(ORDERS["by_country"])
    assert [name for name, _ in summary["top_customers"]] == [name for name, _ in ORDERS["top_customers"]]
    assert [total for _, total in summary["top_customers"]] == pytest.approx(
        [total for _, total in ORDERS["top_customers"]]
    )

    (create,) = fake.Sandbox.create_calls
    assert create["block_network"] is True
    assert not {"outbound_cidr_allowlist", "outbound_domain_allowlist"} & set(create)
    assert create["image"].tag == "python:3.12-slim"
    assert create["timeout"] == 900
    assert create["workdir"] == GUEST_WORKDIR
    assert create["client"].credentials == TOKEN
    assert "airflow_owner" not in create["tags"]  # driven directly, shared with no other task

    (sandbox,) = fake.Sandbox.by_id.values()
    written = {call[1][1] for call in calls_named(sandbox, "filesystem.write_bytes")}
    assert written == {"/workspace/orders.csv", "/workspace/summarise.py"}
    # The script really ran: its output file sits in the sandbox's workspace, equal to what was exported.
    in_sandbox = sandbox.root / "workspace" / "summary.json"
    assert in_sandbox.read_bytes() == (tmp_path / dag_run.run_id / "summary.json").read_bytes()
    assert_nothing_left_running(fake)


def test_modal_attach_example_shares_one_sandbox_then_terminates_it(migrated_airflow_db, fake, tmp_path):
    from sandbox_provider.hooks.modal import ModalSandboxHook
    from sandbox_provider.sandbox import SandboxTerminalError

    dag_run, xcom = run_modal_example("example_sandbox_modal_attach", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)
    assert task_states(dag_run) == {"provision": "success", "analyse": "success", "collect": "success"}

    # One sandbox for the three tasks: provisioned once, the other tasks attached to it by handle.
    (create,) = fake.Sandbox.create_calls
    (sandbox,) = fake.Sandbox.by_id.values()
    handle = xcom("provision")
    assert handle == sandbox.object_id
    assert create["block_network"] is True
    assert create["timeout"] == 1800
    assert "idle_timeout" not in create
    assert create["client"].credentials == TOKEN
    assert create["tags"]["dag_id"] == "example_sandbox_modal_attach"
    assert create["tags"]["airflow_owner"] == f"example_sandbox_modal_attach/{dag_run.run_id}"
    assert fake.Sandbox.from_id_calls and set(fake.Sandbox.from_id_calls) == {handle}

    assert xcom("analyse") == {"orders": 6, "countries": 3}
    report = "# Orders report\n\n| country | revenue (USD) |\n|---|---|\n| DE | 950.50 |\n| JP | 2400.00 |\n| US | 1425.24 |\n"
    collected = xcom("collect")
    assert collected["exit_code"] == 0
    assert collected["stdout"] == report
    url = f"{tmp_path.as_uri()}/{dag_run.run_id}/report.md"
    assert collected["exports"] == {"data/report.md": url}
    assert (tmp_path / dag_run.run_id / "report.md").read_text(encoding="utf-8") == report

    # provision's command ran on the input it wrote (6 orders and a header).
    assert (sandbox.root / "workspace" / "data" / "orders.csv").read_text().count("\n") == 7
    assert_nothing_left_running(fake)
    with pytest.raises(SandboxTerminalError, match="has ended"):
        ModalSandboxHook().read_tags(handle)
