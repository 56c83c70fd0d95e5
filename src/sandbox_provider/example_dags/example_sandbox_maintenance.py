"""
Example: sweep what sandboxes leave behind, every hour.

A worker killed in the middle of a command (out of memory, a node drained, ``kill -9``) cannot end
its sandbox. The next try of the same task ends what earlier tries left, but a task that is never
tried again leaves its sandbox until its lifetime ends, and a backend without a lifetime of its own
(sbx, OpenShell, a Docker Engine whose keeper was stopped) keeps it longer. This Dag runs
``airflow sandboxes sweep`` as a task: it ends every sandbox past its lifetime on the connections
named in ``conn_ids`` (default: every ``AIRFLOW_CONN_*`` connection of a sandbox type and the local
backend's defaults, since a task cannot list the metadata database's connections), leaves those a
task holds or owns, and removes the ``.partial`` files exports left at ``partials_url`` (if given)
more than ``partials_older_than`` seconds ago.
It fails when anything could not be removed, so the failure shows in the UI and alerts.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import DAG, Param, task

with DAG(
    dag_id="example_sandbox_maintenance",
    schedule=timedelta(hours=1),
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    tags=["example", "sandbox", "maintenance"],
    doc_md=__doc__,
    params={
        "conn_ids": Param(None, type=["null", "array"], description="Connections to sweep; null: all it can see."),
        "orphans": Param(False, type="boolean", description="Also end sandboxes whose task instance stopped running."),
        "dry_run": Param(False, type="boolean", description="Report what would be removed; remove nothing."),
        "partials_url": Param(None, type=["null", "string"], description="Where exports go, e.g. s3://bucket/out/."),
        "partials_older_than": Param(3600, type="number", minimum=0, description="Seconds a .partial file is left."),
    },
) as dag:

    @task
    def sweep_sandboxes(params=None) -> dict:
        from sandbox_provider.cli.sweep import sweep

        report = sweep(params["conn_ids"], orphans=params["orphans"], dry_run=params["dry_run"])
        for line in report.lines():
            print(line)
        if not report.ok:
            raise RuntimeError(f"{len(report.failed)} sandboxes could not be removed; see the lines above.")
        return {
            "removed": [item.record.handle for item in report.removed],
            "kept": [item.record.handle for item in report.kept],
            "not_listed": sorted(report.unlisted),
        }

    @task
    def sweep_partial_exports(params=None) -> list[str]:
        from sandbox_provider.cli.sweep import sweep_partials

        if not params["partials_url"] or params["dry_run"]:
            return []
        return sweep_partials(params["partials_url"], older_than=params["partials_older_than"])

    sweep_sandboxes()
    sweep_partial_exports()


if __name__ == "__main__":
    dag.test()
