"""
Examples: sandboxes on Modal.

Two Dags, both needing Modal credentials only when they run (a ``modal`` connection named
``modal_default``, or ``modal token new`` on the worker). Parsing them makes no call to Modal and
reads no connection, and the ``modal`` package itself is imported only inside the tasks.

``example_sandbox_modal_artifact``
    A ``@task`` drives the Modal backend directly: it writes an input file and a script into a
    sandbox with no network, runs the script, reads the result back under a byte limit it picks,
    and destroys the sandbox in a ``finally``. The result is written to storage and its location,
    not its bytes, goes to XCom.

``example_sandbox_modal_attach``
    One sandbox shared by three tasks of a Dag run. ``provision`` creates it with
    ``keep_sandbox=True`` (stamped with this Dag run as owner) and writes the input in;
    ``analyse`` (``@task.sandbox``) attaches by handle and works on the files; ``collect`` runs
    whatever became of ``analyse``, exports the report and destroys the sandbox. A sandbox from
    another run, or a wrong handle from XCom, is refused when attaching. The sandbox lives at most
    ``sandbox_timeout`` seconds from ``provision``, gaps between tasks included, so Modal cleans up
    even if a worker dies.

Outputs go under ``<output_base>/<run_id>/``. ``output_base`` defaults to the
``SANDBOX_DEMO_OUTPUT`` environment variable, else ``file:///tmp/airflow-sandbox-demo``; point it
at ``s3://`` or ``gs://`` (with ``export_conn_id``) in a real deployment.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import DAG, Param, TriggerRule, task

from sandbox_provider.example_dags._output import output_base
from sandbox_provider.hooks.modal import ModalSandboxHook
from sandbox_provider.operators.sandbox import SandboxOperator
from sandbox_provider.sandbox.spec import SandboxSpec

MIB = 1024 * 1024
HANDLE = "{{ ti.xcom_pull(task_ids='provision') }}"

ORDERS = """\
order_id,customer,country,amount_usd
1001,Acme Corp,US,1250.00
1002,Globex,DE,310.50
1003,Initech,US,99.99
1004,Umbrella,JP,2400.00
1005,Acme Corp,US,75.25
1006,Globex,DE,640.00
"""

SUMMARY_SCRIPT = """\
import csv, json, sys
from collections import defaultdict

by_country = defaultdict(float)
by_customer = defaultdict(float)
with open(sys.argv[1], newline="", encoding="utf-8") as source:
    for row in csv.DictReader(source):
        amount = float(row["amount_usd"])
        by_country[row["country"]] += amount
        by_customer[row["customer"]] += amount
top = sorted(by_customer.items(), key=lambda item: item[1], reverse=True)[:3]
with open(sys.argv[2], "w", encoding="utf-8") as target:
    json.dump({"revenue_by_country": dict(sorted(by_country.items())), "top_customers": top}, target, indent=2)
print(f"summarised {sum(by_country.values()):.2f} USD over {len(by_country)} countries")
"""


PARAMS = {"output_base": Param(output_base(), type="string", description="Storage URL for the outputs.")}


with DAG(
    dag_id="example_sandbox_modal_artifact",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox", "modal"],
    params=PARAMS,
    doc_md=__doc__,
) as artifact_dag:

    @task
    def summarise(output_uri: str) -> str:
        from airflow.sdk import ObjectStoragePath

        from sandbox_provider.hooks.modal import ModalSandboxBackend

        # A registry tag keeps the ``modal`` import out of Dag parsing; a task that needs packages can
        # pass modal.Image.from_registry("python:3.12-slim").pip_install("pandas") instead.
        backend = ModalSandboxBackend(image="python:3.12-slim", sandbox_timeout=900)
        # No network: the input arrives through write_file and the output leaves through read_file,
        # so the sandbox needs neither egress nor credentials.
        sandbox = backend.create(spec=SandboxSpec(block_network=True))
        try:
            backend.write_file(sandbox, "/workspace/orders.csv", ORDERS.encode())
            backend.write_file(sandbox, "/workspace/summarise.py", SUMMARY_SCRIPT.encode())
            result = backend.run_command(
                sandbox,
                "python /workspace/summarise.py /workspace/orders.csv /workspace/summary.json",
                timeout=300,
                max_output_bytes=64 * 1024,
            )
            if not result.ok:
                raise RuntimeError(
                    f"The summary failed (exit status {result.exit_code}, timed out: {result.timed_out}): "
                    f"{result.stderr.strip()[-2000:]}"
                )
            print(result.stdout.strip())
            # The budget is what this worker can hold. Over it, read_file raises
            # SandboxFileTooLargeError instead of truncating.
            summary = backend.read_file(sandbox, "/workspace/summary.json", max_bytes=16 * MIB)
        finally:
            # Driving the backend directly means owning teardown, also when the block above raises.
            backend.destroy(sandbox)
        target = ObjectStoragePath(output_uri)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(summary)
        return str(target)

    summarise("{{ params.output_base }}/{{ run_id }}/summary.json")


with DAG(
    dag_id="example_sandbox_modal_attach",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox", "modal"],
    params=PARAMS,
    doc_md=__doc__,
) as attach_dag:
    provision = SandboxOperator(
        task_id="provision",
        # Building the hook here is cheap: it checks its arguments and contacts nobody until the task
        # runs. No idle_timeout: the sandbox waits between tasks, and idleness would reclaim it.
        backend=ModalSandboxHook(sandbox_timeout=1800, tags={"dag_id": "example_sandbox_modal_attach"}),
        files={"data/orders.csv": ORDERS},
        command="wc -l data/orders.csv",
        # The sandbox outlives this task, stamped with this Dag run as owner; its handle is the XCom.
        keep_sandbox=True,
    )

    @task.sandbox(backend=ModalSandboxHook(), attach_to=HANDLE)
    def analyse() -> dict:
        import csv
        from collections import defaultdict

        by_country: dict = defaultdict(float)
        with open("data/orders.csv", newline="", encoding="utf-8") as source:
            rows = list(csv.DictReader(source))
        for row in rows:
            by_country[row["country"]] += float(row["amount_usd"])
        lines = ["# Orders report", "", "| country | revenue (USD) |", "|---|---|"]
        lines += [f"| {country} | {total:.2f} |" for country, total in sorted(by_country.items())]
        with open("data/report.md", "w", encoding="utf-8") as report:
            report.write("\n".join(lines) + "\n")
        return {"orders": len(rows), "countries": len(by_country)}

    collect = SandboxOperator(
        task_id="collect",
        backend=ModalSandboxHook(),
        attach_to=HANDLE,
        command="test -s data/report.md && cat data/report.md",
        exports={"data/report.md": "{{ params.output_base }}/{{ run_id }}/report.md"},
        # Whatever became of analyse, this task removes the sandbox.
        keep_sandbox=False,
        trigger_rule=TriggerRule.ALL_DONE,
    )

    provision >> analyse() >> collect


if __name__ == "__main__":
    attach_dag.test()
