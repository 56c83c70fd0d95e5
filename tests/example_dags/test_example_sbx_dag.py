"""
The guide's two-toolset example (``example_sandbox_sbx``) under ``dag.test()``: a scripted model
drives both prefixed toolsets, each on its own SbxSandboxBackend(host_network_policy="deny-all"),
against the stand-in sbx CLI on PATH. The stand-in has no registry, so both templates run as the
locally built image; the templates asked for are checked from its call log.
"""

from __future__ import annotations

import os

import pytest

from conftest import DOCKER_IMAGE
from scripted_model import Script

pytestmark = pytest.mark.docker

PARSE_PY = "import json, sys\nprint(json.dumps(dict(p.split('=', 1) for p in sys.argv[1].split(';'))))\n"


@pytest.fixture
def standin_on_path(docker_client, tmp_path, monkeypatch):
    from sbx_fixtures import STANDIN, sbx_standin

    with sbx_standin(tmp_path / "sbx", DOCKER_IMAGE) as standin:
        monkeypatch.setenv("PATH", f"{STANDIN.parent}:{os.environ['PATH']}")
        yield standin


def test_two_prefixed_sbx_toolsets_under_dag_test(migrated_airflow_db, scripted_llm, standin_on_path):
    from sandbox_provider.example_dags.example_sandbox_sbx import sbx_dag

    script = scripted_llm(
        Script(
            [
                ("py_write_file", {"path": "parse.py", "content": PARSE_PY}),
                ("node_write_file", {"path": "note.txt", "content": "only in the node sandbox"}),
            ],
            [
                ("py_run_command", {"command": "python3 parse.py 'a=1;b=two'"}),
                ("py_run_command", {"command": "ls"}),
                ("node_run_command", {"command": "ls; test ! -e parse.py && echo separate"}),
            ],
            'Both print {"a": "1", "b": "two"}.',
        )
    )
    dag_run = sbx_dag.test()

    assert {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()} == {"port_the_parser": "success"}
    assert {"py_run_command", "node_run_command", "py_read_file", "node_list_directory"} <= set(script.tool_names)
    texts = script.texts()
    assert texts[2] == '[stdout]\n{"a": "1", "b": "two"}'
    assert texts[3] == "[stdout]\nparse.py"
    assert texts[4] == "[stdout]\nnote.txt\nseparate"
    for prefix in ("py", "node"):
        assert "no network access" in script.descriptions[f"{prefix}_run_command"]
    templates = sorted(
        call.split("--template ")[1].split()[0] for call in standin_on_path.calls() if call.startswith("create")
    )
    assert templates == ["node:22-slim", "python:3.12-slim"]
    assert standin_on_path.containers() == []


def test_without_a_prefix_the_first_model_request_fails():
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UserError

    from sandbox_provider.hooks.sbx import SbxSandboxHook
    from sandbox_provider.toolsets import SandboxToolset

    toolsets = [
        SandboxToolset(SbxSandboxHook(image="python:3.12-slim", host_network_policy="deny-all")),
        SandboxToolset(SbxSandboxHook(image="node:22-slim", host_network_policy="deny-all")),
    ]
    agent = Agent(Script("never reached").model, toolsets=toolsets)
    with pytest.raises(UserError, match="conflicts with existing tool.*run_command"):
        agent.run_sync("hello")
