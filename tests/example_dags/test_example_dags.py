"""The example Dags: each parses with no connection lookup, and each runs end to end under dag.test()."""

from __future__ import annotations

import csv
import json
import os
from unittest import mock

import pytest
from airflow.sdk import BaseHook

from conftest import requires_bwrap
from dag_runs import EXAMPLE_DIR, independent_carrier_stats, load_bag, run_example, task_states

EXAMPLES = sorted(EXAMPLE_DIR.glob("example_*.py"))

needs_bwrap = requires_bwrap


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_parses_without_looking_up_a_connection(path):
    with mock.patch.object(BaseHook, "get_connection") as get_connection:
        bag = load_bag(path)
    assert bag.import_errors == {}
    assert bag.dags, f"{path.name} defines no Dag"
    assert all(dag.tasks for dag in bag.dags.values())
    assert get_connection.call_count == 0


@needs_bwrap
def test_flights_report_holds_the_right_numbers(migrated_airflow_db, tmp_path):
    dag_run, xcom = run_example("example_sandbox_flights", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)

    result = xcom("carrier_stats")
    url = result["exports"]["carrier_stats.csv"]
    assert url == f"{tmp_path.as_uri()}/{dag_run.run_id}/carrier_stats.csv"
    assert result["exit_code"] == 0 and "336776 flights by 16 carriers" in result["stdout"]
    report_path = tmp_path / dag_run.run_id / "carrier_stats.csv"
    rows = {row["carrier"]: row for row in csv.DictReader(report_path.open(encoding="utf-8"))}

    expected = independent_carrier_stats()
    assert set(rows) == set(expected) and len(rows) == 16
    assert sum(int(r["flights"]) for r in rows.values()) == 336776
    assert rows["UA"]["flights"] == "58665" and rows["UA"]["name"] == "United Air Lines Inc."
    assert rows["OO"]["flights"] == "32"
    for carrier, want in expected.items():
        got = rows[carrier]
        assert int(got["flights"]) == want["flights"]
        assert int(got["cancelled"]) == want["cancelled"]
        assert float(got["on_time_rate"]) == pytest.approx(want["on_time_rate"], abs=5e-5)
        assert float(got["mean_arr_delay_min"]) == pytest.approx(want["mean_arr_delay_min"], abs=5e-3)
    # Sorted by number of flights, busiest first.
    assert list(rows)[:3] == ["UA", "B6", "EV"]

    shown = xcom("show_report")
    assert shown == {"report": url, "carriers": 16, "top": report_path.read_text().splitlines()[1]}


@needs_bwrap
def test_hook_example_runs(migrated_airflow_db):
    dag_run, xcom = run_example("example_sandbox_hook")
    assert str(dag_run.state) == "success", task_states(dag_run)
    assert xcom("count_words") == {"lines": 4, "words": 24}


@needs_bwrap
def test_attach_example_shares_one_sandbox_then_removes_it(migrated_airflow_db, tmp_path):
    from sandbox_provider.hooks.local import LocalSandboxHook
    from sandbox_provider.sandbox import SandboxTerminalError

    dag_run, xcom = run_example("example_sandbox_attach", output_base=tmp_path.as_uri())
    assert str(dag_run.state) == "success", task_states(dag_run)
    findings = {"count": 1000, "even": 500, "squares": 31, "total": 500500}
    assert xcom("analyse") == findings
    collected = xcom("collect")
    assert collected["stdout"] == '{"count": 1000, "even": 500, "squares": 31, "total": 500500}'
    exported = tmp_path / dag_run.run_id / "findings.json"
    assert collected["exports"] == {"data/findings.json": f"{tmp_path.as_uri()}/{dag_run.run_id}/findings.json"}
    assert exported.read_text() == collected["stdout"]
    handle = xcom("provision")
    with pytest.raises(SandboxTerminalError, match="does not exist"):
        LocalSandboxHook().read_tags(handle)


@needs_bwrap
def test_assets_example_queues_the_consumer_once_the_producer_exported(migrated_airflow_db, tmp_path, monkeypatch):
    import json

    from dag_runs import asset_events_from, queued_by_assets, sync_dags_defined_here

    monkeypatch.setenv("SANDBOX_DEMO_OUTPUT", str(tmp_path))  # read when the file is parsed
    bag = load_bag(EXAMPLE_DIR / "example_sandbox_assets.py")
    producer, consumer = bag.dags["example_sandbox_assets_producer"], bag.dags["example_sandbox_assets_consumer"]
    sync_dags_defined_here(producer, consumer, unpause=True)
    assets = sorted([f"{tmp_path.as_uri()}/assets/word_counts.json", f"{tmp_path.as_uri()}/assets/by_letter"])
    assert queued_by_assets(consumer.dag_id) == []

    produced = producer.test()

    assert str(produced.state) == "success", task_states(produced)
    assert queued_by_assets(consumer.dag_id) == assets
    events = asset_events_from(producer.dag_id)
    assert events[assets[0]]["file_count"] == len(list((tmp_path / "assets" / "by_letter").iterdir())) > 5
    assert events[assets[1]]["sandbox_path"] == "word_counts.json" and events[assets[1]]["backend"] == "local"

    consumed = consumer.test()

    assert str(consumed.state) == "success", task_states(consumed)
    ti = consumed.get_task_instance("check_counts")
    assert ti is not None and str(ti.state) == "success"
    counts = json.loads((tmp_path / "assets" / "word_counts.json").read_text())
    assert sum(counts.values()) == 36 and counts["the"] == 5 and counts["producer's"] == 1


@needs_bwrap
def test_maintenance_example_sweeps_the_expired_local_sandbox(migrated_airflow_db, tmp_path, monkeypatch):
    import time

    from sandbox_provider.hooks.local import LocalSandboxHook
    from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG

    conn = {"conn_type": "sandbox_local", "extra": {"state_root": str(tmp_path / "state")}}
    monkeypatch.setenv("AIRFLOW_CONN_MAINTENANCE_LOCAL", json.dumps(conn))
    hook = LocalSandboxHook("maintenance_local")
    expired, fresh = hook.create(), hook.create()
    hook.write_tags(expired, {**hook.read_tags(expired), EXPIRES_AT_TAG: str(int(time.time()) - 1)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.csv.airflow-0123456789ab-1.partial").write_bytes(b"cut")
    try:
        dag_run, xcom = run_example(
            "example_sandbox_maintenance",
            conn_ids=["maintenance_local"],
            partials_url=out.as_uri() + "/",
            partials_older_than=0,
        )
        assert str(dag_run.state) == "success", task_states(dag_run)
        assert xcom("sweep_sandboxes") == {"removed": [expired], "kept": [], "not_listed": []}
        assert os.listdir(hook.state_root) == [fresh]
        assert xcom("sweep_partial_exports") == [(out / "a.csv.airflow-0123456789ab-1.partial").as_uri()]
        assert os.listdir(out) == []
    finally:
        hook.destroy(fresh)
        hook.destroy(expired)
