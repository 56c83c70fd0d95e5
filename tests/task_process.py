"""
Run one try of one task the way a worker does: a supervisor process that forks the task process,
relays its log into a log file, and reports to the Execution API (here the in-process one, over the
test's own SQLite database). Tests start this as a subprocess, read the log file while the task runs,
and SIGKILL the supervisor (this process) or the task process (its child) to see what survives.

    python tests/task_process.py DAG_FILE DAG_ID TASK_ID RUN_ID TRY_NUMBER LOG_PATH

With ``TASK_PROCESS_WORKER_LOG=<file>`` this process stays as the worker that started the supervisor
(its standard error goes to that file) and the supervisor is its child (see :func:`as_worker`).

``AIRFLOW_HOME`` must hold a migrated database and ``AIRFLOW__CORE__DAGS_FOLDER`` the Dag file's
folder. ``LOG_PATH`` is relative to ``[logging] base_log_folder``. The exit status is the task's: 0
when it succeeded. The task process's pid is written to ``LOG_PATH`` + ``.pid`` once it has started.
With ``TASK_PROCESS_SECONDS=<file>``, the seconds the supervised try took (from the supervisor's
start to the task's reported end, the in-process Execution API started before) are appended to that file.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def instance(root: Path, **extra: str) -> dict[str, str]:
    """
    An Airflow instance of its own under ``root`` (home, Dag folder ``dags/``, log folder ``logs/``): its
    folders made reachable for a root worker's sandboxes, its database migrated; returns the environment
    to run this harness in, with ``extra`` added.
    """
    import airflow_db

    for folder in (root, *root.parents):
        if str(folder) in ("/", "/tmp"):
            break
        folder.chmod(folder.stat().st_mode | 0o111)  # a root worker's sandboxes run as other users and pass through
    (root / "dags").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(root / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(root / "logs"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS": "False",
        **extra,
    }
    env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
    airflow_db.migrate(env)
    return env


def prepare(dag_file: str, dag_id: str, task_id: str, run_id: str, try_number: int):
    """Sync the Dag into the database, and make its run and the task instance, queued for this try."""
    from airflow import settings
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, DagBag, sync_bag_to_db
    from airflow.models.dagrun import DagRun, get_or_create_dagrun
    from airflow.sdk import timezone
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import TaskInstanceState
    from airflow.utils.types import DagRunTriggeredByType

    dag = DagBag(dag_folder=dag_file).dags[dag_id]
    session = settings.Session()
    manager = DagBundlesManager()
    manager.sync_bundles_to_db(session=session)
    session.commit()
    for bundle in manager.get_all_dag_bundles():
        if not bundle.is_initialized:
            bundle.initialize()
        bag = BundleDagBag(dag_folder=bundle.path, bundle_path=bundle.path, bundle_name=bundle.name)
        sync_bag_to_db(bag, bundle.name, bundle.version)
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    found = session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id).one_or_none()
    now = timezone.utcnow()
    dag_run = found or get_or_create_dagrun(
        dag=scheduler_dag,
        run_id=run_id,
        logical_date=None,
        data_interval=None,
        run_after=now,
        start_date=now,
        conf=None,
        triggered_by=DagRunTriggeredByType.TEST,
        triggering_user_name="task_process",
        session=session,
    )
    ti = dag_run.get_task_instance(task_id, session=session)
    ti.try_number = try_number
    ti.state = TaskInstanceState.QUEUED
    session.merge(ti)
    session.commit()
    return dag, ti


def announce_child(pid_file: Path) -> None:
    """Write the task process's pid once the supervisor has forked it (the only child of this process)."""
    import psutil

    me = psutil.Process()
    while True:
        children = me.children()
        if children:
            pid_file.write_text(str(children[0].pid))
            return
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    dag_file, dag_id, task_id, run_id, try_number, log_path = argv
    from airflow.executors.workloads import BundleInfo
    from airflow.sdk.api.datamodels._generated import TaskInstance as WorkloadTI
    from airflow.sdk.execution_time import supervisor

    dag, ti = prepare(dag_file, dag_id, task_id, run_id, int(try_number))
    workload = WorkloadTI(
        id=ti.id,
        task_id=ti.task_id,
        dag_id=ti.dag_id,
        run_id=ti.run_id,
        try_number=ti.try_number,
        map_index=ti.map_index,
        dag_version_id=ti.dag_version_id,
    )
    from airflow.sdk.configuration import conf

    pid_file = Path(conf.get("logging", "base_log_folder")) / (log_path + ".pid")
    threading.Thread(target=announce_child, args=(pid_file,), daemon=True).start()
    run = getattr(supervisor, "supervise_task", None) or supervisor.supervise
    client = supervisor.InProcessTestSupervisor._api_client(dag)
    timed = os.environ.get("TASK_PROCESS_SECONDS")
    if timed:
        # The in-process Execution API starts on its first request (2-3 s here); a worker's API server
        # is up already, so it is started before the clock does.
        client.get("health/ping").raise_for_status()
    started = time.perf_counter()
    code = run(
        ti=workload,
        bundle_info=BundleInfo(name="dags-folder"),
        dag_rel_path=os.path.relpath(dag_file, os.environ["AIRFLOW__CORE__DAGS_FOLDER"]),
        token="",
        client=client,
        log_path=log_path,
    )
    if timed:
        # The supervised try alone: the task process forked, its Dag parsed, the task run, its state reported.
        with open(timed, "a", encoding="ascii") as f:
            f.write(f"{time.perf_counter() - started:.6f}\n")
    return code


def as_worker(log: str) -> None:
    """
    Stay behind as the worker that started the supervisor, as a LocalExecutor's scheduler or a Celery
    worker does: fork; the child goes on to supervise; this process writes its standard error to ``log``,
    waits for the child and exits with its status. The supervisor's pid goes to ``log`` + ``.supervisor``.
    """
    child = os.fork()
    if child == 0:
        return
    Path(log + ".supervisor").write_text(str(child))
    with open(log, "ab", buffering=0) as err:
        os.dup2(err.fileno(), 2)
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    if os.environ.get("TASK_PROCESS_WORKER_LOG"):
        as_worker(os.environ["TASK_PROCESS_WORKER_LOG"])
    sys.exit(main(sys.argv[1:]))
