"""
The engine's metrics through Airflow's ``Stats``, recorded by a test metrics backend: a timer per step
and the counters, each tagged with the backend (and the connection id); all of them named in the docs.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import pytest
from test_retries import context, left_by

from conftest import requires_bwrap
from dag_runs import run_dag_defined_here, task_states
from fake_hook import FakeSandboxHook
from sandbox_provider.engine import metrics
from sandbox_provider.sandbox import SandboxSession, SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.hook import Capabilities

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "lineage.md"


@pytest.fixture
def hook(tmp_path):
    return FakeSandboxHook(str(tmp_path / "sandboxes"))


def timers(recorder):
    return {m.name: m for m in recorder.named() if m.kind == "timing"}


def counters(recorder):
    return [(m.name, m.value, m.tags) for m in recorder.named() if m.kind == "incr"]


def test_every_step_is_timed_once_and_tagged_with_the_backend(hook, tmp_path, recorded_metrics):
    source = tmp_path / "in.txt"
    source.write_text("x\n")
    with SandboxSession(
        hook, inputs={"in.txt": source.as_uri()}, exports={"in.txt": (tmp_path / "out.txt").as_uri()}
    ) as session:
        session.ensure()  # stages as a step of its own
        assert session.run("cat in.txt", timeout=30, max_output_bytes=100).ok
    sent = timers(recorded_metrics)
    assert sorted(sent) == sorted(metrics.TIMERS)
    assert [m.name for m in recorded_metrics.named()].count("sandbox.run") == 1
    for metric in sent.values():
        assert metric.tags["backend"] == "fake" and "conn_id" not in metric.tags
        assert isinstance(metric.value, timedelta) and metric.value >= timedelta(0)
    assert sent["sandbox.run"].tags["staged"] == "false"
    assert counters(recorded_metrics) == []


def test_staging_with_the_command_is_part_of_its_run(hook, tmp_path, recorded_metrics):
    with SandboxSession(hook, files={"a.txt": "a"}) as session:
        session.run("cat a.txt", timeout=30, max_output_bytes=100)  # the files go in with the command
    sent = timers(recorded_metrics)
    assert "sandbox.stage" not in sent
    assert sent["sandbox.run"].tags == {"backend": "fake", "staged": "true"}


def test_a_command_past_its_deadline_counts_a_timeout(hook, recorded_metrics):
    with SandboxSession(hook) as session:
        assert session.run("sleep 30", timeout=0.5, max_output_bytes=100).timed_out
    assert ("sandbox.timeouts", 1, {"backend": "fake"}) in counters(recorded_metrics)
    assert session.report.timed_out and session.report.exit_code is None


def test_a_spec_the_backend_cannot_enforce_counts_a_refusal(tmp_path, recorded_metrics):
    strict = FakeSandboxHook(str(tmp_path), capabilities=Capabilities(open_network=False))
    with pytest.raises(SandboxTerminalError, match="cannot enforce"):
        SandboxSession(strict, spec=SandboxSpec(block_network=False))
    assert counters(recorded_metrics) == [("sandbox.refusals", 1, {"backend": "fake"})]
    assert timers(recorded_metrics) == {}  # nothing was provisioned


class FailingCreate(FakeSandboxHook):
    def _provision(self, request):
        raise RuntimeError("the vendor said no")


def test_a_failed_step_counts_a_failure_with_its_step_and_no_timer(tmp_path, recorded_metrics):
    with pytest.raises(RuntimeError, match="vendor said no"):
        SandboxSession(FailingCreate(str(tmp_path))).ensure()
    assert counters(recorded_metrics) == [("sandbox.failures", 1, {"backend": "fake", "step": "create"})]
    assert "sandbox.create" not in timers(recorded_metrics)


def test_a_failed_export_counts_an_export_failure(hook, tmp_path, recorded_metrics):
    with pytest.raises(SandboxTerminalError, match="Could not export"):
        with SandboxSession(hook, exports={"missing.txt": (tmp_path / "out.txt").as_uri()}) as session:
            session.run("true", timeout=30, max_output_bytes=100)
    assert ("sandbox.failures", 1, {"backend": "fake", "step": "export"}) in counters(recorded_metrics)
    assert "sandbox.export" not in timers(recorded_metrics)
    assert "sandbox.destroy" in timers(recorded_metrics)  # torn down all the same


def test_sandboxes_an_earlier_try_left_are_counted_as_leftovers_swept(hook, recorded_metrics):
    left_by(hook, 1), left_by(hook, 2)
    with SandboxSession(hook, context=context(try_number=3)) as session:
        session.ensure()
    assert ("sandbox.leftovers_swept", 2, {"backend": "fake"}) in counters(recorded_metrics)


def test_the_counter_api_for_a_sweep(hook, recorded_metrics):
    metrics.count_leftovers_swept(hook, 0)
    metrics.count_leftovers_swept(hook, 3)
    assert counters(recorded_metrics) == [("sandbox.leftovers_swept", 3, {"backend": "fake"})]
    with pytest.raises(ValueError, match="not a sandbox counter"):
        metrics.count("sandbox.nonsense", hook)


def test_a_broken_metrics_backend_never_fails_the_job(hook, recorded_metrics):
    with mock.patch.object(recorded_metrics, "timing", side_effect=OSError("statsd is down")):
        with SandboxSession(hook) as session:
            assert session.run("true", timeout=30, max_output_bytes=100).ok


@requires_bwrap
def test_a_task_run_sends_them_tagged_with_its_connection(migrated_airflow_db, add_connection, recorded_metrics):
    from airflow.sdk import DAG

    from sandbox_provider.operators.sandbox import SandboxOperator

    conn_id = add_connection("sandbox_local_metrics", "sandbox_local")
    with DAG(
        dag_id=f"metrics_{uuid.uuid4().hex[:8]}", schedule=None, start_date=datetime(2024, 1, 1, tzinfo=UTC)
    ) as dag:
        SandboxOperator(task_id="job", backend=conn_id, command="echo hi", files={"a.txt": "a"})
    dag_run = run_dag_defined_here(dag)
    assert str(dag_run.state) == "success", task_states(dag_run)
    sent = timers(recorded_metrics)
    assert {"sandbox.create", "sandbox.run", "sandbox.destroy"} <= set(sent)
    for metric in sent.values():
        assert metric.tags["backend"] == "local" and metric.tags["conn_id"] == conn_id


def test_the_docs_name_every_metric_and_its_tags():
    page = DOCS_PAGE.read_text(encoding="utf-8")
    named = set(re.findall(r"`(sandbox\.[a-z_]+)`", page))
    assert set(metrics.TIMERS) | set(metrics.COUNTERS) <= named
    assert named <= set(metrics.TIMERS) | set(metrics.COUNTERS), "the page names a metric that is not sent"
    for tag in ("backend", "conn_id", "step", "staged"):
        assert f"`{tag}`" in page
