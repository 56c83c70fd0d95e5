"""
A chatty command in a real task (issue 28): ``seq 1 200000`` through ``SandboxOperator`` against the
same command through the hook alone, each in a real task run the way a worker runs it (a supervisor
process that forks the task process and relays its log into a log file: ``tests/task_process.py``),
interleaved (operator, hook, hook, operator, ...).

Both tasks time themselves inside the task process: the operator's ``execute`` (provision, run with
the output going to the task log, the log caught up, destroy) against a ``@task`` that does create,
``run_command`` and destroy with the hook and logs nothing of the output. Airflow's own start and end
of a task are the same on both sides and left out. Rows:

- ``log_output_max_bytes`` = the cap: within 2x of the hook alone (the goal), the output in the log
  within the cap, and the result's tail exact;
- the default (every line the log keeps up with) and ``"head_tail"``: the same, for the record.

Each row also gives the task log's size and the output bytes in it.

    .venv/bin/python benchmarks/bench_task_log.py [--rounds 5] [--lines 200000] [--cap 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Comparison  # noqa: E402

HARNESS = Path(__file__).resolve().parents[1] / "tests" / "task_process.py"
sys.path.insert(0, str(HARNESS.parent))

import task_process  # noqa: E402

DAG = """
import os
import time

from airflow.sdk import DAG, task

from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.operators.sandbox import SandboxOperator

LINES = int(os.environ["BENCH_LINES"])
COMMAND = f"seq 1 {LINES}"
# The end of the output the result must keep exactly (the XCom's 2000 characters).
EXPECTED = "".join(f"{i}\\n" for i in range(1, LINES + 1))[-1990:]


def hook():
    return LocalSandboxHook(state_root=os.environ["BENCH_STATE_ROOT"])


class Timed(SandboxOperator):
    def execute(self, context):
        started = time.perf_counter()
        result = super().execute(context)
        took = time.perf_counter() - started
        if not result["stdout"].endswith(EXPECTED):
            raise RuntimeError("the result's tail is not the end of the output")
        self.log.info("bench: took %.6f", took)
        return result


with DAG("chatty", schedule=None):
    for name, settings in {
        "cap": {"log_output_max_bytes": int(os.environ["BENCH_CAP"])},
        "all": {},
        "head_tail": {"log_output": "head_tail"},
    }.items():
        Timed(task_id=f"operator_{name}", backend=hook(), command=COMMAND, timeout=600, **settings)

    @task
    def hook_alone():
        import logging

        started = time.perf_counter()
        sandboxes = hook()
        handle = sandboxes.create()
        try:
            result = sandboxes.run_command(handle, COMMAND, timeout=600, max_output_bytes=1024 * 1024)
        finally:
            sandboxes.destroy(handle)
        took = time.perf_counter() - started
        if not result.ok or not result.stdout.endswith(EXPECTED):
            raise RuntimeError("the hook's result is not the output")
        logging.getLogger("bench").info("bench: took %.6f", took)

    hook_alone()
"""


def run_real_task(env: dict[str, str], dag_file: Path, dag_id: str, task_id: str, run_id: str, log: Path):
    """
    Run one try of ``task_id`` as a worker does (``tests/task_process.py``), its log at ``log`` (under the
    instance's ``logs/``); return the log's events and the seconds its ``bench: took <seconds>`` lines give.

    :raises RuntimeError: when the task failed or logged no time, with the end of its log.
    """
    relative = log.relative_to(log.parents[1])
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(dag_file), dag_id, task_id, run_id, "1", str(relative)],
        env=env,
        capture_output=True,
        text=True,
    )
    events = [json.loads(line).get("event", "") for line in log.read_text().splitlines() if line.startswith("{")]
    took = [float(e.split()[-1]) for e in events if str(e).startswith("bench: took ")]
    if done.returncode != 0 or not took:
        raise RuntimeError(f"{task_id} failed ({done.returncode}): {events[-20:]} {done.stderr[-2000:]}")
    return events, took


class Instance:
    """An Airflow home of its own, with a migrated database, the Dag above and a log folder."""

    def __init__(self, root: Path, lines: int, cap: int) -> None:
        self.root = root
        self.env = task_process.instance(
            root, BENCH_STATE_ROOT=str(root / "state"), BENCH_LINES=str(lines), BENCH_CAP=str(cap)
        )
        (root / "state").mkdir()
        (root / "dags" / "chatty.py").write_text(textwrap.dedent(DAG))
        self.runs = 0

    def run(self, task_id: str) -> dict:
        """One try of ``task_id`` in its own run; what its log says: seconds, log size, output lines and bytes."""
        self.runs += 1
        run_id = f"bench-{self.runs}"
        log = self.root / "logs" / run_id / f"{task_id}.log"
        events, took = run_real_task(self.env, self.root / "dags" / "chatty.py", "chatty", task_id, run_id, log)
        output = [e.split(" ", 1)[1] for e in events if str(e).startswith(("[stdout] ", "[stderr] "))]
        return {
            "seconds": took[0],
            "log_bytes": log.stat().st_size,
            "lines": len(output),
            "output_bytes": sum(len(line.encode()) + 1 for line in output),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--cap", type=int, default=2048, help="log_output_max_bytes of the capped row")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("use at least 5 rounds")
    with tempfile.TemporaryDirectory(prefix="bench-task-log-") as root:
        instance = Instance(Path(root), args.lines, args.cap)
        variants = ("cap", "all", "head_tail")
        ours: dict[str, list[dict]] = {v: [] for v in variants}
        theirs: dict[str, list[dict]] = {v: [] for v in variants}
        instance.run("hook_alone")  # warm-up: the first run pays for caches the later ones find
        for i in range(args.rounds):
            for variant in variants:
                pair = [("ours", f"operator_{variant}"), ("theirs", "hook_alone")]
                for side, task_id in pair if i % 2 == 0 else pair[::-1]:
                    (ours if side == "ours" else theirs)[variant].append(instance.run(task_id))
        for variant in variants:
            comparison = Comparison(
                f"seq 1 {args.lines}, {variant}",
                "the hook alone",
                [r["seconds"] for r in ours[variant]],
                [r["seconds"] for r in theirs[variant]],
            )
            goal = "(goal <= 2x)" if variant == "cap" else ""
            print(comparison.row(goal), flush=True)
            logs = ours[variant]
            print(
                f"    task log: median {statistics.median(r['log_bytes'] for r in logs) / 1024:.0f} KiB "
                f"(max {max(r['log_bytes'] for r in logs) / 1024:.0f} KiB), output lines in it: median "
                f"{statistics.median(r['lines'] for r in logs):.0f}, output bytes in it: max "
                f"{max(r['output_bytes'] for r in logs)}"
                + (
                    f" (cap {args.cap}: {'within' if max(r['output_bytes'] for r in logs) <= args.cap else 'OVER'})"
                    if variant == "cap"
                    else ""
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
