"""
The Modal example Dags run end to end under dag.test(), through the real ``modal`` SDK against the
Modal stand-in on loopback (``tests/hooks/modal/modal_server.py``): the tasks' commands really run in
the stand-in's sandboxes, whose ``/workspace`` is their own.
"""

from __future__ import annotations

import json

import pytest
from modal_server import ModalServer, modal_server_fixture, sandbox_rpc  # noqa: F401 - the stand-in's fixture

from dag_runs import task_states

MODAL_FILE = "example_sandbox_modal.py"
GUEST_WORKDIR = "/workspace"
#: The connection's token pair, which only the stand-in knows (not the worker's ``TOKEN``).
CONNECTION_TOKEN = ("ak-example-token", "as-example-secret")

ORDERS = {  # the ORDERS table of the example, recomputed by hand
    "by_country": {"DE": 950.50, "JP": 2400.00, "US": 1425.24},
    "top_customers": [["Umbrella", 2400.00], ["Acme Corp", 1325.25], ["Globex", 950.50]],
}


@pytest.fixture
def modal(modal_server: ModalServer, add_connection) -> ModalServer:
    """The stand-in, with its token pair in the modal_default connection the example's hooks read."""
    modal_server.tokens = {CONNECTION_TOKEN}
    add_connection("modal_default", "modal", login=CONNECTION_TOKEN[0], password=CONNECTION_TOKEN[1])
    return modal_server


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


def assert_nothing_left_running(modal: ModalServer) -> None:
    """Every sandbox ended by a terminate call, which was the last call naming it; none is listed as running."""
    assert modal.sandboxes and all(record.result is not None for record in modal.sandboxes.values())
    for sandbox_id in modal.sandboxes:
        naming = [call.rpc for call in modal.calls if getattr(call.request, "sandbox_id", None) == sandbox_id]
        assert naming[-1] == sandbox_rpc("SandboxTerminate"), (
            f"{sandbox_id}: a call was made after it was terminated: {naming}"
        )
    assert all(not running for running in modal.running_commands().values())


def helper_writes(modal: ModalServer) -> set[str]:
    """The paths the sandbox filesystem API wrote to."""
    writes = set()
    for request in modal.requests("TaskExecStart"):
        args = list(request.command_args)
        if len(args) == 2 and args[0].endswith("modal-sandbox-fs-tools") and "WriteFile" in args[1]:
            writes.add(json.loads(args[1])["WriteFile"]["path"])
    return writes


def test_modal_artifact_example_writes_the_summary(migrated_airflow_db, modal, tmp_path):
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

    record = modal.sandbox()
    assert record.network.blocked and not record.network.allowlist
    assert record.image_tag == "python:3.12-slim"
    assert record.definition.timeout_secs == 900
    assert record.workdir == GUEST_WORKDIR
    assert {call.token_id for call in modal.calls if call.rpc == sandbox_rpc("SandboxCreate")} == {CONNECTION_TOKEN[0]}
    assert "airflow_owner" not in record.tags  # driven directly, shared with no other task

    assert helper_writes(modal) == {"/workspace/orders.csv", "/workspace/summarise.py"}
    # The script really ran: its output file sits in the sandbox's workspace, equal to what was exported.
    in_sandbox = record.path("/workspace/summary.json")
    assert in_sandbox.read_bytes() == (tmp_path / dag_run.run_id / "summary.json").read_bytes()
    assert_nothing_left_running(modal)


def test_modal_attach_example_shares_one_sandbox_then_terminates_it(migrated_airflow_db, modal, tmp_path):
    from sandbox_provider.hooks.modal import ModalSandboxHook
    from sandbox_provider.sandbox import SandboxTerminalError

    dag_run, xcom = run_modal_example("example_sandbox_modal_attach", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)
    assert task_states(dag_run) == {"provision": "success", "analyse": "success", "collect": "success"}

    # One sandbox for the three tasks: provisioned once, the other tasks attached to it by handle.
    record = modal.sandbox()
    handle = xcom("provision")
    assert handle == record.sandbox_id
    assert modal.count(sandbox_rpc("SandboxCreate")) == 1
    assert record.network.blocked
    assert record.definition.timeout_secs == 1800
    assert not record.definition.HasField("idle_timeout_secs")
    assert {call.token_id for call in modal.calls if call.rpc == sandbox_rpc("SandboxCreate")} == {CONNECTION_TOKEN[0]}
    assert record.tags["dag_id"] == "example_sandbox_modal_attach"
    assert record.tags["airflow_owner"] == f"example_sandbox_modal_attach/{dag_run.run_id}"
    # analyse and collect found the sandbox by its id.
    assert {r.sandbox_id for r in modal.requests(sandbox_rpc("SandboxWait")) if r.timeout == 0} == {handle}

    assert xcom("analyse") == {"orders": 6, "countries": 3}
    report = "# Orders report\n\n| country | revenue (USD) |\n|---|---|\n| DE | 950.50 |\n| JP | 2400.00 |\n| US | 1425.24 |\n"
    collected = xcom("collect")
    assert collected["exit_code"] == 0
    assert collected["stdout"] == report
    url = f"{tmp_path.as_uri()}/{dag_run.run_id}/report.md"
    assert collected["exports"] == {"data/report.md": url}
    assert (tmp_path / dag_run.run_id / "report.md").read_text(encoding="utf-8") == report

    # provision's command ran on the input it wrote (6 orders and a header).
    assert record.path("/workspace/data/orders.csv").read_text().count("\n") == 7
    assert_nothing_left_running(modal)
    with pytest.raises(SandboxTerminalError, match="has ended"):
        ModalSandboxHook().read_tags(handle)
