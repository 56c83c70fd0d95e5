"""
What every task pays once (issue 32): ``@task.sandbox`` returning ``a + b`` on ``/usr/bin/python3``
against ``@task.external_python`` of the same function, each a real task run the way a worker runs it
(a supervisor process that forks a new task process, which builds its own hook, asks the supervisor
for connections and launches bubblewrap for the first time: ``tests/task_process.py``), interleaved
(each side first, second and last in turn). ``@task.external_python`` runs two ways a user would set
it up: on the same plain interpreter, declared as one (``expect_airflow=False``), and on a virtualenv
with Airflow (this one's interpreter), as the operator expects by default (its script then imports
Airflow).

Three figures per side, per run:

- ``execute``: the task's own work, timed inside the task process (``pre_execute`` to
  ``post_execute``): for ``@task.sandbox`` a new hook, create, stage, run, read the result, destroy;
  for ``@task.external_python`` its interpreter checks, the function's script and a new Python;
- the supervised try: the supervisor's work from its start to the task's reported end, as a worker
  spends it on one try (the task process forked, the Dag file parsed in it, ``execute``, the
  result and state reported to the Execution API, the log closed);
- the whole run: the harness process from start to exit (Airflow's own start and end of a task, the
  same on both sides, included).

Goal (issue 32): the ``execute`` ratio at most 0.6x. Then the part of the supervised try that is
Airflow's alone (the try less ``execute``) on each side, and what the try's ratio would be if the
sandbox's ``execute`` took no time at all: the lowest that row can go. A try now and then takes 5 s
more on either side: the supervisor sometimes sees the task's sockets close before its exit, and
waits out its heartbeat interval; the medians stand. Rows are printed as they are measured, with the
load average; a side that fails prints why.

    .venv/bin/python benchmarks/bench_task_run.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_task_log import run_real_task, task_process  # noqa: E402
from harness import Comparison, attempt, print_rows  # noqa: E402

DAG = """
import logging
import os
import time

from airflow.sdk import DAG, task

from sandbox_provider.hooks.local import LocalSandboxHook

_started = {}


def start(context):
    _started["at"] = time.perf_counter()


def stop(context, result):
    if result != 5:
        raise RuntimeError(f"a + b gave {result!r}")
    logging.getLogger("bench").info("bench: took %.6f", time.perf_counter() - _started["at"])


def add(a, b):
    return a + b


with DAG("task_run", schedule=None):
    task.sandbox(
        python="/usr/bin/python3",
        backend=LocalSandboxHook(state_root=os.environ["BENCH_STATE_ROOT"]),
        task_id="sandboxed",
        pre_execute=start,
        post_execute=stop,
    )(add)(2, 3)
    # A plain interpreter, declared as one (no Airflow there to look for).
    task.external_python(
        python="/usr/bin/python3", expect_airflow=False, task_id="external", pre_execute=start, post_execute=stop
    )(add)(2, 3)
    # A virtualenv with Airflow, as the operator expects by default (expect_airflow=True).
    task.external_python(
        python=os.environ["BENCH_AIRFLOW_PYTHON"], task_id="external_airflow", pre_execute=start, post_execute=stop
    )(add)(2, 3)
"""


class Instance:
    """An Airflow home of its own, with a migrated database, the Dag above and a log folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.times = root / "supervised.txt"
        self.env = task_process.instance(
            root,
            BENCH_STATE_ROOT=str(root / "state"),
            TASK_PROCESS_SECONDS=str(self.times),
            BENCH_AIRFLOW_PYTHON=sys.executable,
        )
        (root / "state").mkdir()
        (root / "dags" / "task_run.py").write_text(textwrap.dedent(DAG))
        self.runs = 0
        self.floors: list[str] = []  # what the supervised try's ratio would be with no execute at all

    def run(self, task_id: str) -> tuple[float, float, float]:
        """
        One try of ``task_id`` in its own Dag run: seconds (in execute, of the supervised try, of the
        whole harness run).
        """
        self.runs += 1
        run_id = f"bench-{self.runs}"
        log = self.root / "logs" / run_id / f"{task_id}.log"
        started = time.perf_counter()
        _, took = run_real_task(self.env, self.root / "dags" / "task_run.py", "task_run", task_id, run_id, log)
        whole = time.perf_counter() - started
        supervised = float(self.times.read_text().split()[-1])
        return took[0], supervised, whole


#: The two ``@task.external_python`` tasks of the Dag: a plain interpreter, a virtualenv with Airflow.
ALTERNATIVES = {
    "external": "@task.external_python",
    "external_airflow": "@task.external_python, Airflow there",
}


def measure(instance: Instance, rounds: int) -> list:
    sides = ["sandboxed", *ALTERNATIVES]
    times: dict[str, list[tuple[float, float, float]]] = {task_id: [] for task_id in sides}
    for task_id in sides:
        instance.run(task_id)  # warm-up: the first run of each pays for caches (the Dag's parse, .pyc files)
    for i in range(rounds):
        for task_id in sides[i % 3 :] + sides[: i % 3]:  # each side first, second and last in turn
            times[task_id].append(instance.run(task_id))
    ours = times["sandboxed"]
    name = "@task.sandbox a+b, real task"
    airflow_ours = statistics.median(o[1] - o[0] for o in ours)
    rows = []
    for task_id, label in ALTERNATIVES.items():
        theirs = times[task_id]
        rows += [
            (Comparison(f"{name}: execute", label, [o[0] for o in ours], [t[0] for t in theirs]), "(goal <= 0.6x)"),
            (
                Comparison(f"{name}: supervised try", label, [o[1] for o in ours], [t[1] for t in theirs]),
                "(what a worker spends on the try: the task process forked, the Dag parsed, execute, the state "
                "reported)",
            ),
        ]
        airflow_theirs = statistics.median(t[1] - t[0] for t in theirs)
        instance.floors.append(
            f"Airflow's part of the supervised try (the try less execute): {airflow_ours * 1000:.1f} ms here, "
            f"{airflow_theirs * 1000:.1f} ms for {label}; with an execute of no time at all the supervised try's "
            f"ratio would be {airflow_ours / statistics.median(t[1] for t in theirs):.2f}x"
        )
    theirs = times["external"]
    rows.append(
        (
            Comparison(f"{name}: whole run", ALTERNATIVES["external"], [o[2] for o in ours], [t[2] for t in theirs]),
            "(the harness process too: Airflow's start, the Dag synced to the database, the same on both sides)",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("use at least 5 rounds")
    with tempfile.TemporaryDirectory(prefix="bench-task-run-") as root:
        instance = Instance(Path(root))
        print_rows(attempt("@task.sandbox a+b, real task", lambda: measure(instance, args.rounds)))
        for line in instance.floors:
            print(line, flush=True)
        left = os.listdir(Path(root) / "state")
        print(f"left in the state root after the runs: {len(left)} {left[:3]}", flush=True)


if __name__ == "__main__":
    main()
