"""
``@task.sandbox`` on Docker against what a user would pick instead, run by hand against a real Engine:

    bash scripts/docker/prepare.sh
    .venv/bin/python benchmarks/bench_docker_task.py [--rounds 9]

The same function, ``return a + b``, timed in-task (the operator's ``execute``), interleaved in one
process (``harness.compare``):

1. ``@task.sandbox`` with a ``DockerSandboxHook`` against ``@task.docker`` (the
   ``apache-airflow-providers-docker`` of the ``bench`` extra) on the same image, with no network.
   Goal: median ratio at most 1.0.
2. ``@task.sandbox`` against the floor: ``docker run --rm --network none <image> python3 -c ...``.
   Reported, no goal.

It also prints the Engine requests one ``@task.sandbox`` call made (counted at the SDK's
``APIClient.send``). Exits 0 either way: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
CONN_ID = "sandbox_docker_bench"
os.environ.setdefault(
    f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps({"conn_type": "sandbox_docker", "extra": {"image": IMAGE}})
)
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")

from airflow.sdk import DAG, task  # noqa: E402


@task.sandbox
def add_in_sandbox(a, b):
    return a + b


@task.docker(image=IMAGE, network_mode="none", auto_remove="success")
def add_in_docker(a, b):
    return a + b


def run_task(decorated, **overrides):
    """Build the task in a throwaway Dag and run its operator's execute() with a minimal context."""
    with DAG("bench_docker_task", schedule=None) as dag:
        decorated(1, 2)
    operator = dag.tasks[0]
    for name, value in overrides.items():
        setattr(operator, name, value)
    ti = mock.MagicMock(dag_id="bench_docker_task", run_id="r", task_id=operator.task_id, map_index=-1, try_number=1)
    assert operator.execute({"ti": ti, "run_id": "r"}) == 3


def count_requests(fn) -> list[tuple[str, str]]:
    import docker.api.client

    sent: list[tuple[str, str]] = []
    original = docker.api.client.APIClient.send

    def send(client, request, **kwargs):
        sent.append((request.method, request.path_url.split("?")[0]))
        return original(client, request, **kwargs)

    docker.api.client.APIClient.send = send
    try:
        fn()
    finally:
        docker.api.client.APIClient.send = original
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    from harness import compare, print_table

    from sandbox_provider.hooks.docker import DockerSandboxHook

    def ours() -> None:
        # A new hook per task, as each task process builds its own.
        run_task(add_in_sandbox, backend=DockerSandboxHook(CONN_ID, pull="never"))

    def floor() -> None:
        subprocess.run(
            ["docker", "run", "--rm", "--network", "none", IMAGE, "python3", "-c", "print(1 + 2)"],
            check=True,
            capture_output=True,
        )

    ours()
    sent = count_requests(ours)
    versus_docker = compare(
        "@task.sandbox (Docker)", ours, "@task.docker", lambda: run_task(add_in_docker), rounds=args.rounds
    )
    versus_floor = compare("@task.sandbox (Docker)", ours, "docker run --rm python3 -c", floor, rounds=args.rounds)
    print_table([(versus_docker, "goal: median ratio <= 1.0"), (versus_floor, "(the floor; no goal)")])
    print(f"Engine requests of one @task.sandbox call: {len(sent)}: {', '.join(m + ' ' + p for m, p in sent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
