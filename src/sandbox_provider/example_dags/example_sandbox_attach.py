"""
Example: one sandbox shared by three tasks of a Dag run.

- ``provision`` creates the sandbox with ``keep_sandbox=True`` and writes the input in. It stamps
  the sandbox with this Dag run as its owner and returns the handle as its XCom.
- ``analyse`` is a ``@task.sandbox`` function that attaches by that handle, reads the input, writes
  its findings next to it and returns a summary. The sandbox stays up when it ends.
- ``collect`` runs whatever became of ``analyse`` (``trigger_rule=ALL_DONE``): it attaches, exports
  the findings to storage, and destroys the sandbox (``keep_sandbox=False``).

A sandbox from another Dag run, or a wrong handle, is refused when attaching. Attaching needs a
backend that can find a sandbox from another task: the local backend can, on one worker host
(``airflow dags test``, LocalExecutor).

The findings go to ``<output_base>/<run_id>/findings.json``; ``output_base`` defaults to the
``SANDBOX_DEMO_OUTPUT`` environment variable, else ``file:///tmp/airflow-sandbox-demo``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import DAG, Param, TriggerRule, task

from sandbox_provider.example_dags._output import output_base
from sandbox_provider.operators.sandbox import SandboxOperator

HANDLE = "{{ ti.xcom_pull(task_ids='provision') }}"


with DAG(
    dag_id="example_sandbox_attach",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox"],
    params={"output_base": Param(output_base(), type="string", description="Storage URL for the findings.")},
    doc_md=__doc__,
) as dag:
    provision = SandboxOperator(
        task_id="provision",
        # The sandbox outlives this task; its handle is the XCom.
        keep_sandbox=True,
        command="mkdir -p data && seq 1 1000 > data/numbers.txt",
    )

    @task.sandbox(attach_to=HANDLE)
    def analyse() -> dict:
        import json

        with open("data/numbers.txt", encoding="utf-8") as handle:
            numbers = [int(line) for line in handle if line.strip()]
        findings = {
            "count": len(numbers),
            "total": sum(numbers),
            "even": sum(1 for n in numbers if n % 2 == 0),
            "squares": sum(1 for n in numbers if int(n**0.5) ** 2 == n),
        }
        with open("data/findings.json", "w", encoding="utf-8") as handle:
            json.dump(findings, handle, sort_keys=True)
        return findings

    collect = SandboxOperator(
        task_id="collect",
        attach_to=HANDLE,
        command="test -s data/findings.json && cat data/findings.json",
        exports={"data/findings.json": "{{ params.output_base }}/{{ run_id }}/findings.json"},
        # Whatever happened to analyse, this task removes the sandbox.
        keep_sandbox=False,
        trigger_rule=TriggerRule.ALL_DONE,
    )

    provision >> analyse() >> collect


if __name__ == "__main__":
    dag.test()
