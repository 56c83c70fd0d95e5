"""
Lineage of sandbox jobs: OpenLineage names for storage URLs, Assets where URLs go, the OpenLineage
events of a real task run (files, directories and globs on ``file://`` and ``memory://`` storage), the
same run with the OpenLineage provider absent, and the toolset's exports through hook lineage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from airflow.sdk import Asset, AssetAlias, AssetAll

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.engine.lineage import dataset_name, plan_assets
from sandbox_provider.operators.sandbox import SandboxOperator

RUNNER = Path(__file__).with_name("lineage_run.py")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///data/out.csv", ("file", "/data/out.csv")),
        ("file:///data/tables/", ("file", "/data/tables")),
        ("s3://bucket/a/b.csv", ("s3://bucket", "a/b.csv")),
        ("s3://bucket/prefix/", ("s3://bucket", "prefix")),
        ("S3A://bucket/k", ("s3://bucket", "k")),
        ("gs://bucket/k.parquet", ("gs://bucket", "k.parquet")),
        ("gcs://bucket/k.parquet", ("gs://bucket", "k.parquet")),
        ("s3://aws_conn@bucket/key", ("s3://bucket", "key")),
        (
            "abfss://container@account.dfs.core.windows.net/p/f",
            ("abfss://container@account.dfs.core.windows.net", "p/f"),
        ),
        ("memory://bucket/k/v.csv", ("memory://bucket", "k/v.csv")),
        ("hdfs://namenode:8020/warehouse/t/", ("hdfs://namenode:8020", "warehouse/t")),
    ],
)
def test_dataset_names_follow_openlineage_naming(url, expected):
    assert dataset_name(url) == expected


def test_a_dataset_name_needs_a_url():
    with pytest.raises(ValueError, match="not a storage URL"):
        dataset_name("/data/out.csv")


# -- Assets where URLs go ------------------------------------------------------------------------------------


def test_assets_become_urls_inlets_and_outlets():
    source, report = Asset("s3://bucket/in/table/"), Asset("file:///data/report.txt")
    plan = plan_assets(
        {"table/": source, "raw.csv": "s3://bucket/raw.csv"},
        {"report.txt": report, "out/*.csv": Asset("file:///data/csv"), "log.txt": "file:///data/{{ ds }}/log.txt"},
    )
    assert plan.inputs == {"table/": "s3://bucket/in/table/", "raw.csv": "s3://bucket/raw.csv"}
    assert plan.exports == {
        "report.txt": "file:///data/report.txt",
        "out/*.csv": "file:///data/csv/",  # a glob's destination is a directory
        "log.txt": "file:///data/{{ ds }}/log.txt",
    }
    assert plan.inlets == [source]
    assert plan.outlets == [report, Asset("file:///data/csv")]


def test_exports_as_assets_makes_each_literal_url_an_outlet():
    plan = plan_assets({}, {"a.txt": "s3://bucket/a.txt", "d/": "s3://bucket/d/"}, exports_as_assets=True)
    assert plan.outlets == [Asset("s3://bucket/a.txt"), Asset("s3://bucket/d")]


def test_exports_as_an_alias_adds_the_alias_only():
    alias = AssetAlias("reports")
    plan = plan_assets({}, {"a.txt": "s3://bucket/{{ ds }}/a.txt"}, exports_as_assets=alias)
    assert plan.outlets == [alias] and plan.export_assets == {}


@pytest.mark.parametrize(
    ("inputs", "exports", "mode", "message"),
    [
        ({}, {"a.txt": "s3://b/{{ ds }}/a.txt"}, True, r"template .* exports_as_assets=AssetAlias"),
        ({}, {"a.txt": AssetAlias("x")}, False, "names no single location"),
        ({"a": AssetAll(Asset("s3://b/a"))}, {}, False, r"inputs\['a'\] .* names no single location"),
        ({}, {"out": Asset("s3://b/out/")}, False, r"End the sandbox path with '/' \(out/\)"),
        ({}, {"a.txt": "s3://b/a.txt"}, "yes", "must be True, False or an AssetAlias"),
    ],
)
def test_what_cannot_be_an_asset_is_refused_when_the_dag_is_parsed(inputs, exports, mode, message):
    with pytest.raises(ValueError, match=message):
        SandboxOperator(task_id="t", command="true", inputs=inputs, exports=exports, exports_as_assets=mode)


def test_an_asset_also_listed_in_outlets_is_there_once():
    report = Asset("file:///data/report.txt")
    op = SandboxOperator(task_id="t", command="true", exports={"r.txt": report}, outlets=[report])
    assert op.outlets == [report]


def test_task_sandbox_takes_assets_too():
    from airflow.sdk import DAG, task

    result, source = Asset("file:///data/result.json"), Asset("file:///data/in.csv")
    with DAG(dag_id="decorated_assets", schedule=None) as dag:

        @task.sandbox(exports={"result.json": result}, inputs={"in.csv": source})
        def work() -> None:
            pass

        work()
    op = dag.get_task("work")
    assert op.outlets == [result] and op.inlets == [source]
    assert op.exports == {"result.json": "file:///data/result.json"}


def test_the_facets_on_start_read_no_connection():
    from unittest import mock

    from airflow.sdk import BaseHook

    from sandbox_provider.sandbox import SandboxSpec

    op = SandboxOperator(
        task_id="t",
        backend="sandbox_docker_default",
        command="true",
        spec=SandboxSpec(block_network=True, allow_egress_to=["pypi.org"]),
        inputs={"in.csv": "s3://raw/in.csv"},
        exports={"out/": "gs://reports/daily/"},
    )
    with mock.patch.object(BaseHook, "get_connection") as get_connection:
        lineage = op.get_openlineage_facets_on_start()
    assert get_connection.call_count == 0  # the OpenLineage provider may call this from a forked process
    assert [(d.namespace, d.name) for d in lineage.inputs] == [("s3://raw", "in.csv")]
    assert [(d.namespace, d.name) for d in lineage.outputs] == [("gs://reports", "daily")]
    facet = lineage.run_facets["sandbox"]
    assert (facet.backend, facet.connId, facet.network, facet.allowedEgress) == (
        "unknown",
        "sandbox_docker_default",
        "allowlist",
        ["pypi.org"],
    )


# -- OpenLineage, end to end -----------------------------------------------------------------------------------


def run_in_own_process(mode: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(RUNNER), mode, str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((work / "result.json").read_text())


def datasets(event: dict, side: str) -> list[tuple[str, str]]:
    return [(d["namespace"], d["name"]) for d in event.get(side, [])]


@requires_bwrap
def test_the_openlineage_events_of_a_task_run_list_its_datasets(tmp_path, migrated_airflow_db):
    work = tmp_path / "with"
    result = run_in_own_process("with-openlineage", work)
    assert result["state"] == "success"
    assert result["openlineage_modules_loaded"]  # the provider was there (the control of the test below)
    events = [json.loads(line) for line in (work / "events.jsonl").read_text().splitlines()]
    task_events = {e["eventType"]: e for e in events if e["job"]["name"].endswith(".job")}
    start, complete = task_events["START"], task_events["COMPLETE"]
    base = str(work)
    expected_inputs = [
        ("file", f"{base}/in/words.txt"),
        ("file", f"{base}/in/table"),  # a directory is one dataset
        ("memory://lineage-bucket", "in/rates.csv"),
    ]
    expected_outputs = [
        ("file", f"{base}/out/report.txt"),
        ("file", f"{base}/out/tree"),
        ("file", f"{base}/out/glob"),  # a glob's destination directory
        ("memory://lineage-bucket", "out/deep"),
    ]
    for event in (start, complete):
        assert datasets(event, "inputs") == expected_inputs
        assert datasets(event, "outputs") == expected_outputs
    statistics = [
        (o["outputFacets"]["outputStatistics"]["size"], o["outputFacets"]["outputStatistics"]["fileCount"])
        for o in complete["outputs"]
    ]
    # report.txt "3\n"; the tree: all.csv (8 bytes), deep/rates.csv (7), a.csv and b.csv (2 each); the glob: a, b, all.
    assert statistics == [(2, 1), (19, 4), (12, 3), (7, 1)]
    facet = complete["run"]["facets"]["sandbox"]
    assert facet["backend"] == "local" and facet["network"] == "blocked" and facet["exitCode"] == 0
    assert facet["handle"].startswith("airflow-sandbox-") and facet["durationSeconds"] >= 0
    assert 0 < facet["lifetimeSeconds"] <= 3600 and facet["timedOut"] is False
    assert facet["_schemaURL"].endswith("#/$defs/SandboxRunFacet")
    assert "handle" not in start["run"]["facets"]["sandbox"]  # nothing was provisioned when the task started
    assert [e["uri"] for e in result["asset_events"]] == [f"file://{base}/out/report.txt"]


@requires_bwrap
def test_without_the_openlineage_provider_nothing_breaks(tmp_path, migrated_airflow_db):
    result = run_in_own_process("without-openlineage", tmp_path / "without")
    assert result["state"] == "success"
    assert result["openlineage_modules_loaded"] == []
    assert result["memory_exports"] == ["/lineage-bucket/out/deep/rates.csv"]
    assert result["asset_events"][0]["extra"]["file_count"] == 1


def test_the_run_facet_matches_its_schema(tmp_path):
    import jsonschema
    from openlineage.client.serde import Serde

    from sandbox_provider.engine.lineage import SandboxReport
    from sandbox_provider.engine.openlineage import SandboxRunFacet

    schema_path = Path(__file__).resolve().parents[2] / "src/sandbox_provider/engine/facets/SandboxRunFacet.json"
    schema = json.loads(schema_path.read_text())
    own = schema["$defs"]["SandboxRunFacet"]["allOf"][1]
    report = SandboxReport(backend="docker", conn_id="sandbox_docker", image="python:3.12", network="allowlist")
    report.allowed_egress = ["pypi.org"]
    facet = json.loads(Serde.to_json(SandboxRunFacet.of(report)))
    jsonschema.validate(facet, own)
    assert set(facet) - {"_producer", "_schemaURL"} <= set(own["properties"])


# -- the toolset, through hook lineage ---------------------------------------------------------------------------


@pytest.fixture
def hook_lineage(monkeypatch):
    """A real hook lineage collector (Airflow makes one only when a lineage reader is installed)."""
    import airflow.sdk.lineage as sdk_lineage
    from airflow.providers.common.compat import sdk as compat_sdk

    collector = sdk_lineage.HookLineageCollector()
    monkeypatch.setattr(sdk_lineage, "get_hook_lineage_collector", lambda: collector)
    monkeypatch.setattr(compat_sdk, "get_hook_lineage_collector", lambda: collector, raising=False)
    return collector


def test_the_toolset_reports_its_exports_and_the_openlineage_provider_reads_them(tmp_path, hook_lineage):
    from airflow.providers.common.compat.openlineage.utils.utils import translate_airflow_asset

    from sandbox_provider.toolsets import SandboxToolset

    hook = FakeSandboxHook(str(tmp_path / "sandboxes"))
    out = tmp_path / "out"
    toolset = SandboxToolset(
        hook,
        exports={
            "answer.txt": (out / "answer.txt").as_uri(),
            "notes/": (out / "notes").as_uri() + "/",
            "notes/*.md": (out / "md").as_uri() + "/",
        },
    )
    with toolset:
        toolset.call("write_file", path="answer.txt", content="42")
        toolset.call("write_file", path="notes/a.md", content="a")
        toolset.call("write_file", path="notes/b.txt", content="bb")

    collected = hook_lineage.collected_assets
    assert collected.inputs == []
    assert [(o.asset.uri, o.asset.extra) for o in collected.outputs] == [
        ((out / "answer.txt").as_uri(), {"bytes": 2, "file_count": 1, "backend": "fake"}),
        ((out / "notes").as_uri(), {"bytes": 3, "file_count": 2, "backend": "fake"}),
        ((out / "md").as_uri(), {"bytes": 1, "file_count": 1, "backend": "fake"}),
    ]
    assert all(o.context is hook for o in collected.outputs)
    translated = [translate_airflow_asset(o.asset, o.context) for o in collected.outputs]
    assert [(d.namespace, d.name) for d in translated] == [
        ("file", str(out / "answer.txt")),
        ("file", str(out / "notes")),
        ("file", str(out / "md")),
    ]


def test_a_session_reports_the_inputs_it_staged(tmp_path, hook_lineage):
    from sandbox_provider.sandbox import SandboxSession

    source = tmp_path / "in.txt"
    source.write_text("x")
    with SandboxSession(FakeSandboxHook(str(tmp_path / "s")), inputs={"in.txt": source.as_uri()}) as session:
        assert hook_lineage.collected_assets.inputs == []  # nothing staged yet
        session.run("cat in.txt", timeout=30, max_output_bytes=100)
    assert [i.asset.uri for i in hook_lineage.collected_assets.inputs] == [source.as_uri()]
