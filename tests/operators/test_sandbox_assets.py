"""
Exports as Airflow Assets under ``dag.test()`` with the real local backend: a Dag scheduled on an
export's Asset is queued after the export succeeds, never after a failed command or a failed export;
the event says what was exported; templated destinations go through an ``AssetAlias``; an input given
as an Asset is read from its URI.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from airflow.sdk import DAG, Asset, AssetAlias

from conftest import requires_bwrap
from dag_runs import asset_events_from as events_from
from dag_runs import queued_by_assets as queued_for
from dag_runs import run_dag_defined_here, sync_dags_defined_here, task_states
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.operators.sandbox import SandboxOperator

pytestmark = requires_bwrap


@pytest.fixture
def hook(tmp_path):
    return LocalSandboxHook(state_root=str(tmp_path / "state"))


def new_dag(name: str, schedule=None) -> DAG:
    return DAG(
        dag_id=f"assets_{name}_{uuid.uuid4().hex[:8]}",
        schedule=schedule,
        start_date=datetime(2024, 1, 1, tzinfo=UTC),
        catchup=False,
    )


def producer_and_consumer(hook, tmp_path, command: str):
    report = Asset((tmp_path / "published" / "report.txt").as_uri())
    tables = (tmp_path / "published" / "tables").as_uri() + "/"
    with new_dag("producer") as producer:
        SandboxOperator(
            task_id="produce",
            backend=hook,
            command=command,
            exports={"report.txt": report, "tables/": tables},
            exports_as_assets=True,
        )
    with new_dag("consumer", schedule=[report, Asset(tables.rstrip("/"))]) as consumer:
        SandboxOperator(task_id="consume", backend=hook, command="true")
    sync_dags_defined_here(consumer, unpause=True)
    return producer, consumer, report


def test_a_dag_scheduled_on_the_exports_is_queued_after_they_succeed(hook, tmp_path, migrated_airflow_db):
    producer, consumer, report = producer_and_consumer(
        hook, tmp_path, "mkdir -p tables && echo 42 > report.txt && echo a > tables/a.csv && echo bb > tables/b.csv"
    )
    assert producer.task_dict["produce"].outlets == [report, Asset((tmp_path / "published" / "tables").as_uri())]

    dag_run = run_dag_defined_here(producer)

    assert str(dag_run.state) == "success", task_states(dag_run)
    tables_uri = (tmp_path / "published" / "tables").as_uri()
    assert queued_for(consumer.dag_id) == sorted([report.uri, tables_uri])
    events = events_from(producer.dag_id)
    handle = events[report.uri]["handle"]
    assert handle.startswith("airflow-sandbox-")
    assert events[report.uri] == {
        "bytes": 3,
        "file_count": 1,
        "backend": "local",
        "handle": handle,
        "sandbox_path": "report.txt",
    }
    assert events[tables_uri] == {
        "bytes": 5,
        "file_count": 2,
        "backend": "local",
        "handle": handle,
        "sandbox_path": "tables/",
    }
    assert (tmp_path / "published" / "report.txt").read_text() == "42\n"


@pytest.mark.parametrize(
    "command",
    [
        pytest.param("echo 42 > report.txt; exit 3", id="the command fails"),
        pytest.param("echo 42 > report.txt", id="the export fails: no tables/ to copy"),
    ],
)
def test_a_failed_run_emits_nothing_and_queues_nothing(hook, tmp_path, migrated_airflow_db, command):
    producer, consumer, report = producer_and_consumer(hook, tmp_path, command)

    dag_run = run_dag_defined_here(producer)

    assert str(dag_run.state) == "failed", task_states(dag_run)
    assert queued_for(consumer.dag_id) == []
    assert events_from(producer.dag_id) == {}
    assert not (tmp_path / "published" / "report.txt").exists()  # all or nothing: not even the report landed


def test_templated_destinations_are_emitted_through_an_alias(hook, tmp_path, migrated_airflow_db):
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    alias = AssetAlias(f"sandbox-reports-{uuid.uuid4().hex[:8]}")
    with new_dag("alias") as producer:
        op = SandboxOperator(
            task_id="produce",
            backend=hook,
            command="echo hi > out.txt",
            exports={"out.txt": tmp_path.as_uri() + "/{{ run_id }}/out.txt"},
            exports_as_assets=alias,
        )
    assert op.outlets == [alias]

    dag_run = run_dag_defined_here(producer)

    assert str(dag_run.state) == "success", task_states(dag_run)
    rendered = f"{tmp_path.as_uri()}/{dag_run.run_id}/out.txt"
    with create_session() as session:
        (event,) = session.query(AssetEvent).filter_by(source_dag_id=producer.dag_id).all()
        assert event.asset.uri == rendered
        assert [a.name for a in event.source_aliases] == [alias.name]
        assert event.extra["bytes"] == 3 and event.extra["backend"] == "local"


def test_an_input_given_as_an_asset_is_read_from_its_uri(hook, tmp_path, migrated_airflow_db):
    source = tmp_path / "shared" / "numbers.txt"
    source.parent.mkdir()
    source.write_text("1\n2\n3\n")
    numbers = Asset(source.as_uri())
    with new_dag("inlet") as dag:
        op = SandboxOperator(
            task_id="read", backend=hook, inputs={"numbers.txt": numbers}, command="test $(wc -l < numbers.txt) = 3"
        )
    assert op.inlets == [numbers] and op.inputs == {"numbers.txt": source.as_uri()}

    dag_run = run_dag_defined_here(dag)

    assert str(dag_run.state) == "success", task_states(dag_run)
