"""
Benchmarks for the Kubernetes backend, run by hand against the cluster of
``scripts/kubernetes/prepare.sh``, each measured interleaved (``harness.compare``: A, B, A, B ...,
median, min and max of the per-round time ratio, ours / theirs) against what a user would pick instead
on the same cluster, the cncf provider's KubernetesPodOperator:

    bash scripts/kubernetes/prepare.sh
    .venv/bin/python benchmarks/bench_kubernetes.py [--rounds 5] [--part all|lifecycle|task|burst] [--burst 20]

1. ``lifecycle``: ``create`` + ``run_command("python3 -c 'print(1 + 2)'")`` + ``destroy`` through the hook
   (the default spec: no network, so a NetworkPolicy too), against ``KubernetesPodOperator.execute`` running
   the same command in a Pod of the same image (it creates the Pod, waits for it to end, reads its log and
   deletes it). Goal: median ratio at most 1.0.
2. ``task``: ``@task.sandbox`` against ``@task.kubernetes`` on the same function (``return a + b``), timed
   in-task (the operator's ``execute``); KPO's result comes through its XCom sidecar. Goal: at most 1.0.
3. ``burst``: ``--burst`` sandboxes at once (one thread and one hook each: create, run, destroy). Goal:
   0 errors, and 0 leftovers once the cluster has finished the deletions: no Pod or NetworkPolicy of the
   provider in the namespace, no container of the namespace's Pods on the Docker Engine.

Both sides run as the cluster's admin in a namespace of this run's own, deleted at the end, on an image
built FROM the sandbox image with ``python`` naming ``python3`` (``@task.kubernetes`` runs ``python``).
Prints the table and one JSON object of figures. Exits 0 either way: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import types
import uuid
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402  (first: it sets Airflow's test mode up)

STATE = os.environ.get("SANDBOX_KUBERNETES_STATE", "/var/lib/airflow-sandbox-kubernetes")
BENCH_IMAGE = "airflow-sandbox-python-bench:bookworm"
CONN_ID = "kubernetes_sandbox_bench"
NAMESPACE = f"sandbox-bench-{uuid.uuid4().hex[:8]}"
os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps(
    {
        "conn_type": "kubernetes",
        "extra": {
            "kube_config_path": os.path.join(STATE, "admin.kubeconfig"),
            "namespace": NAMESPACE,
            # The sandbox backend's settings, and KPO's XCom sidecar (its default image is on no registry here).
            "image": BENCH_IMAGE,
            "image_pull_policy": "Never",
            "cpu_request": 0.05,
            "memory_request_bytes": 32 * 1024 * 1024,
            "network_policy_enforced": True,  # the test cluster's plugin enforces none: the policies are sent all the same
            "xcom_sidecar_container_image": BENCH_IMAGE,
        },
    }
)

from airflow.sdk import DAG, task  # noqa: E402
from harness import Comparison, compare, print_table  # noqa: E402

Row = tuple[Comparison, str]
COMMAND = "print(1 + 2)"


def build_image() -> None:
    """The sandbox image with ``python`` naming ``python3``, built locally (no registry)."""
    dockerfile = f"FROM {floors.IMAGE}\nRUN ln -sf python3 /usr/bin/python\n"
    subprocess.run(
        ["docker", "build", "-q", "-t", BENCH_IMAGE, "-"],
        input=dockerfile.encode(),
        check=True,
        capture_output=True,
        env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )


def context(task_id: str) -> dict:
    ti = mock.MagicMock(dag_id="bench_kubernetes", run_id="r", task_id=task_id, map_index=-1, try_number=1)
    return {"ti": ti, "task_instance": ti, "run_id": "r", "dag": types.SimpleNamespace(dag_id="bench_kubernetes")}


def kpo(**kwargs):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    return KubernetesPodOperator(
        task_id="kpo",
        namespace=NAMESPACE,
        image=BENCH_IMAGE,
        image_pull_policy="Never",
        kubernetes_conn_id=CONN_ID,
        on_finish_action="delete_pod",
        in_cluster=False,
        **kwargs,
    )


# -- 1. create + run + destroy against KubernetesPodOperator --------------------------------------------------


def lifecycle_row(*, rounds: int) -> Row:
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    hook = KubernetesSandboxHook(CONN_ID)

    def ours() -> None:
        handle = hook.create()
        result = hook.run_command(handle, f"python3 -c '{COMMAND}'", timeout=60, max_output_bytes=4096)
        assert result.ok and result.stdout == "3\n", result
        hook.destroy(handle)

    def theirs() -> None:
        # A new operator per run, as each task has its own.
        kpo(cmds=["python3", "-c", COMMAND], get_logs=True).execute(context("kpo"))

    comparison = compare("create+run+destroy (Kubernetes)", ours, "KubernetesPodOperator", theirs, rounds=rounds)
    return comparison, "(goal <= 1.0x)"


# -- 2. @task.sandbox against @task.kubernetes -----------------------------------------------------------------


@task.sandbox
def add_in_sandbox(a, b):
    return a + b


def run_task(decorated, task_id: str, **overrides) -> None:
    """Build the task in a throwaway Dag and run its operator's execute() with a minimal context."""
    with DAG("bench_kubernetes", schedule=None) as dag:
        decorated(1, 2)
    operator = dag.tasks[0]
    for name, value in overrides.items():
        setattr(operator, name, value)
    result = operator.execute(context(task_id))
    assert result == 3, result


def task_row(*, rounds: int) -> Row:
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    @task.kubernetes(
        namespace=NAMESPACE,
        image=BENCH_IMAGE,
        image_pull_policy="Never",
        kubernetes_conn_id=CONN_ID,
        on_finish_action="delete_pod",
        in_cluster=False,
        do_xcom_push=True,  # how @task.kubernetes returns a value (through its XCom sidecar)
    )
    def add_in_pod(a, b):
        return a + b

    def ours() -> None:
        # A new hook per task, as each task process builds its own.
        run_task(add_in_sandbox, "sandbox", backend=KubernetesSandboxHook(CONN_ID))

    def theirs() -> None:
        run_task(add_in_pod, "kpo")

    comparison = compare("@task.sandbox a+b (Kubernetes)", ours, "@task.kubernetes", theirs, rounds=rounds)
    return comparison, "(goal <= 1.0x)"


# -- 3. a burst of sandboxes at once ---------------------------------------------------------------------------


def burst(count: int) -> dict:
    """``count`` sandboxes at once, each created, used and destroyed by a thread and hook of its own."""
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    errors: list[str] = []
    times: list[float] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        began = time.perf_counter()
        try:
            hook = KubernetesSandboxHook(CONN_ID)
            handle = hook.create()
            try:
                result = hook.run_command(handle, f"echo {index}", timeout=120, max_output_bytes=4096)
                assert result.ok and result.stdout == f"{index}\n", result
            finally:
                hook.destroy(handle)
        except Exception as err:  # counted, not raised: the burst reports its errors
            with lock:
                errors.append(f"{type(err).__name__}: {err}")
        with lock:
            times.append(time.perf_counter() - began)

    began = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    leftovers, settled = leftovers_after(120)
    return {
        "sandboxes": count,
        "errors": len(errors),
        "error_messages": errors[:5],
        "wall_seconds": round(wall, 2),
        "slowest_sandbox_seconds": round(max(times), 2) if times else None,
        "leftovers": leftovers,
        "seconds_until_none_left": settled,
        "goal_met": not errors and not any(leftovers.values()),
    }


def leftovers_after(patience: float) -> tuple[dict, float | None]:
    """What the provider left in the namespace and on the Engine, once the deletions have run (or ``patience`` ran out)."""
    core, net = admin_apis()
    selector = "app.kubernetes.io/managed-by=airflow-provider-sandbox"
    began = time.monotonic()
    while True:
        found = {
            "pods": len(core.list_namespaced_pod(NAMESPACE, label_selector=selector).items),
            "network_policies": len(net.list_namespaced_network_policy(NAMESPACE, label_selector=selector).items),
            "containers": len(
                subprocess.run(
                    ["docker", "ps", "-aq", "--filter", f"label=io.kubernetes.pod.namespace={NAMESPACE}"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
            ),
        }
        waited = time.monotonic() - began
        if not any(found.values()):
            return found, round(waited, 1)
        if waited > patience:
            return found, None
        time.sleep(0.5)


def admin_apis():
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(os.path.join(STATE, "admin.kubeconfig"), client_configuration=configuration)
    api = client.ApiClient(configuration)
    return client.CoreV1Api(api), client.NetworkingV1Api(api)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--part", choices=("all", "lifecycle", "task", "burst"), default="all")
    parser.add_argument("--burst", type=int, default=20)
    args = parser.parse_args()
    logging_off()
    build_image()
    core, _ = admin_apis()
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    rows: list[Row] = []
    figures: dict = {"provenance": floors.provenance(), "namespace": NAMESPACE}
    try:
        if args.part in ("all", "lifecycle"):
            rows.append(lifecycle_row(rounds=args.rounds))
        if args.part in ("all", "task"):
            rows.append(task_row(rounds=args.rounds))
        print_table(rows)
        if args.part in ("all", "burst"):
            figures["burst"] = burst(args.burst)
    finally:
        core.delete_namespace(NAMESPACE)
    for comparison, _ in rows:
        r = comparison.ratios
        figures[comparison.name] = {
            "ours_median_s": round(statistics.median(comparison.ours), 3),
            "theirs_median_s": round(statistics.median(comparison.baseline), 3),
            "ratio_median": round(statistics.median(r), 3),
            "ratio_min": round(min(r), 3),
            "ratio_max": round(max(r), 3),
            "n": len(r),
            "goal_met": statistics.median(r) <= 1.0,
        }
    print(json.dumps(figures, indent=2))


def logging_off() -> None:
    import logging

    logging.disable(logging.WARNING)


if __name__ == "__main__":
    main()
