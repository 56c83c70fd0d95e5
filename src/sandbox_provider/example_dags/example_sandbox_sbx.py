"""
Example: one agent with two sandboxes on Docker Sandboxes (``sbx``), one for Python and one for Node.

Both toolsets define ``run_command``, ``read_file``, ``write_file`` and ``list_directory``, and tool
names must be unique within an agent, so each gets a ``tool_prefix`` (``py_run_command``,
``node_run_command``, ...). The instructions say which sandbox is for what.

The worker needs the ``sbx`` CLI, ``sbx login`` and a host policy initialised with
``sbx policy init deny-all``, which ``host_network_policy="deny-all"`` declares: sbx enforces egress
host-wide, so only then can the sandboxes be offline. sbx sandboxes have no lifetime of their own:
the toolset removes them when the run ends, and ``SbxSandboxHook().remove_expired()`` sweeps what a
killed worker left.

The model comes from the Airflow connection ``pydanticai_default``, looked up when the task runs.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.providers.common.ai.operators.agent import AgentOperator
from airflow.sdk import DAG

from sandbox_provider.sandbox import SbxSandboxBackend
from sandbox_provider.toolsets import SandboxToolset

with DAG(
    dag_id="example_sandbox_sbx",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox", "agent", "sbx"],
    doc_md=__doc__,
) as sbx_dag:
    AgentOperator(
        task_id="port_the_parser",
        llm_conn_id="pydanticai_default",
        prompt=(
            "parse.py splits 'key=value;key=value' strings into a dict. Write a Node.js version, parse.js, "
            "that prints the same JSON for the same input, and show both outputs for 'a=1;b=two'."
        ),
        system_prompt=(
            "The py_ tools work in a sandbox with Python 3.12, the node_ tools in a separate sandbox with "
            "Node.js 22; files do not move between them, and neither has network access."
        ),
        toolsets=[
            SandboxToolset(
                SbxSandboxBackend(image="python:3.12-slim", host_network_policy="deny-all"),
                tool_prefix="py",
            ),
            SandboxToolset(
                SbxSandboxBackend(image="node:22-slim", host_network_policy="deny-all"),
                tool_prefix="node",
            ),
        ],
    )


if __name__ == "__main__":
    sbx_dag.test()
