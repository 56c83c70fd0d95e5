"""
Example: an agent that writes code, runs it in a sandbox, and hands a file downstream.

Two Dags, both on the local bubblewrap backend (``LocalSandboxHook``), which needs no service:

- ``example_sandbox_agent``: ``normalize`` is an ``AgentOperator`` with a ``SandboxToolset``. The
  model writes the vendor sample and a Python script into the sandbox, runs the script, reads the
  traceback when it fails and fixes it. When the run succeeds, the toolset copies ``staging.csv``
  out to ``<output_base>/<run_id>/staging.csv`` and deletes the sandbox; ``load`` counts the rows.
- ``example_sandbox_agent_attach``: ``provision`` creates a sandbox for this Dag run and writes the
  input; ``analyse`` is an agent attached to that sandbox (``attach_to``), so its files stay after
  the run; ``collect`` (``ALL_DONE``) exports the report and destroys the sandbox.

The model comes from the Airflow connection ``pydanticai_default`` (type ``pydanticai``), looked
up when the agent task runs, never when this file is parsed. ``output_base`` defaults to the
``SANDBOX_DEMO_OUTPUT`` environment variable, else ``file:///tmp/airflow-sandbox-demo``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.providers.common.ai.operators.agent import AgentOperator
from airflow.sdk import DAG, ObjectStoragePath, Param, TriggerRule, task

from sandbox_provider.example_dags._output import output_base
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.operators.sandbox import SandboxOperator
from sandbox_provider.toolsets import SandboxToolset

LLM_CONN_ID = "pydanticai_default"
STAGING_URI = "{{ params.output_base }}/{{ run_id }}/staging.csv"
HANDLE = "{{ ti.xcom_pull(task_ids='provision') }}"

VENDOR_SAMPLE = """\
OrderNo;Customer;Date;Amount;Country
A-1001;Acme GmbH;03.01.2024;1.234,50;DE
A-1002;Globex SA;17.01.2024;99,00;FR
A-1003;Initech Ltd;31.01.2024;12.000,00;GB
"""


DAG_ARGS: dict[str, Any] = {
    "schedule": None,
    "start_date": datetime(2024, 1, 1, tzinfo=UTC),
    "catchup": False,
    "tags": ["example", "sandbox", "agent"],
    "params": {"output_base": Param(output_base(), type="string", description="Storage URL for the results.")},
    "doc_md": __doc__,
}

with DAG(dag_id="example_sandbox_agent", **DAG_ARGS) as agent_dag:
    normalize = AgentOperator(
        task_id="normalize",
        llm_conn_id=LLM_CONN_ID,
        prompt=(
            "Here is a sample of this month's vendor export:\n\n"
            f"{VENDOR_SAMPLE}\n"
            "Write it to vendor.csv, then write a Python script that turns it into staging.csv with the "
            "columns order_id, customer_name, ordered_at (ISO date) and amount (decimal with a dot) and "
            "country_code. Run the script and fix it until every row parses, then say which columns you "
            "mapped to which."
        ),
        system_prompt=(
            "You have a sandbox with Python 3 and its standard library, no network, and an empty working "
            "directory. Write scripts to files and run them; read tracebacks and fix the code rather "
            "than guess."
        ),
        toolsets=[
            SandboxToolset(
                LocalSandboxHook(),
                # Copied out when the run succeeds, before the sandbox is deleted. If the agent never
                # wrote it, the task fails rather than leaving ``load`` to find nothing.
                exports={"staging.csv": STAGING_URI},
            )
        ],
    )

    @task
    def load(staging_uri: str) -> int:
        """Count the data rows the agent produced."""
        with ObjectStoragePath(staging_uri).open("r") as staging:
            return sum(1 for line in staging if line.strip()) - 1

    normalize >> load(STAGING_URI)


with DAG(dag_id="example_sandbox_agent_attach", **DAG_ARGS) as attach_dag:
    provision = SandboxOperator(
        task_id="provision",
        # Stamped with this Dag run as owner; the handle is the XCom the agent attaches by.
        keep_sandbox=True,
        command=("mkdir -p data && printf 'region,amount\\nnorth,120\\nsouth,80\\nnorth,30\\n' > data/sales.csv"),
    )

    analyse = AgentOperator(
        task_id="analyse",
        llm_conn_id=LLM_CONN_ID,
        prompt=(
            "data/sales.csv holds this month's sales. Work out the total per region and write it as "
            "Markdown to data/report.md."
        ),
        system_prompt=(
            "You have a sandbox with Python 3 and no network. The run_command description says whose "
            "sandbox it is and how long it has left. Write scripts to files and run them."
        ),
        toolsets=[SandboxToolset(LocalSandboxHook(), attach_to=HANDLE)],
    )

    collect = SandboxOperator(
        task_id="collect",
        attach_to=HANDLE,
        command="test -s data/report.md && cat data/report.md",
        exports={"data/report.md": "{{ params.output_base }}/{{ run_id }}/report.md"},
        # Whatever became of the agent, this task removes the sandbox.
        keep_sandbox=False,
        trigger_rule=TriggerRule.ALL_DONE,
    )

    provision >> analyse >> collect


if __name__ == "__main__":
    agent_dag.test()
