"""
The battery every backend with detached commands passes with ``deferrable=True``, under ``dag.test()``
and in a real triggerer process (``airflow triggerer`` against an Airflow instance of the test's own,
the task's tries run by a real supervisor, ``tests/task_process.py``).

A backend's test module subclasses :class:`DeferredBattery` and gives:

- ``backend_code``: Python that, in a Dag file, sets ``BACKEND`` to the hook and ``SPEC`` to the
  sandboxes' spec (None for the default), environment variables of ``backend_env`` at hand, the same
  for the test process and the Dag file of the real runs;
- ``backend_env`` (fixture): the environment the worker and the triggerer need for it;
- ``sandboxes(dag_id, run_id)``: the handles of the sandboxes a run left on the backend.

Every case runs on Docker; on the other backends every ``dag.test()`` case runs too, and the two
real-triggerer cases (each starts Airflow processes of its own, a minute or two on a loaded machine)
only with ``SANDBOX_DEFERRED_ALL_BACKENDS=1``: CI runs the suite twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import airflow_db

TESTS = Path(__file__).resolve().parents[1]
HARNESS = TESTS / "task_process.py"
#: Seconds a step may take on a loaded machine before a test gives up (a bound, not an assertion).
PATIENCE = 240
#: The bound on a test that runs a worker's try, a triggerer, and the try's resumption as processes of
#: their own, one after the other: each Airflow process takes up to a minute or two to start on a
#: loaded two-core machine, and the command itself runs a minute.
REAL_RUN_SECONDS = 900


def long_command(seconds: int) -> str:
    """A command of about ``seconds`` seconds: 30 numbered lines on stdout, evenly spaced, and one on stderr."""
    return f'for i in $(seq 1 30); do echo "line $i"; sleep {seconds / 30:.3f}; done; echo done >&2'


DAG_FILE = """
import os

from airflow.sdk import DAG
from sandbox_provider.operators.sandbox import SandboxOperator

SPEC = None
{backend_code}

with DAG("deferred", schedule=None):
    SandboxOperator(
        task_id="t",
        backend=BACKEND,
        spec=SPEC,
        command=os.environ["TEST_COMMAND"],
        deferrable=True,
        poll_interval=1,
        timeout=600,
    )
"""


def relayed_lines(text: str) -> list[str]:
    """The ``[stdout] ...`` and ``[stderr] ...`` lines in a log's text, in order."""
    # The console shows each as "[stdout] <line>" padded, then "[logger] loc=..."; the tests' lines hold no
    # run of two spaces.
    return re.findall(r"\[(?:stdout|stderr)\] (.*?)(?: {2,}\[| *$)", text, re.MULTILINE)


class Instance:
    """An Airflow instance of its own: home, migrated SQLite database, Dag folder, log folder."""

    def __init__(self, root: Path, env: dict[str, str], backend_code: str) -> None:
        root.mkdir()
        for folder in (root, *root.parents):
            if str(folder) in ("/", "/tmp"):
                break
            folder.chmod(folder.stat().st_mode | 0o111)
        (root / "dags").mkdir()
        self.dag_file = root / "dags" / "deferred.py"
        self.dag_file.write_text(textwrap.dedent(DAG_FILE).format(backend_code=textwrap.dedent(backend_code)))
        self.root = root
        self.logs = root / "logs"
        self.env = {
            **os.environ,
            **env,
            "AIRFLOW_HOME": str(root / "home"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.logs),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS": "False",
            # A killed triggerer's triggers go to the next one after this many seconds without a heartbeat.
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            "AIRFLOW__SCHEDULER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "6",
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "6",
        }
        self.env.pop("AIRFLOW__CORE__UNIT_TEST_MODE", None)
        airflow_db.migrate(self.env)
        self.triggerers: list[subprocess.Popen] = []

    def run_try(self, run_id: str, command: str) -> int:
        """Run one try (or its resumption) of ``deferred.t`` under a real supervisor; its exit status."""
        log = f"{run_id}/1.log"
        done = subprocess.run(
            [sys.executable, str(HARNESS), str(self.dag_file), "deferred", "t", run_id, "1", log],
            env={**self.env, "TEST_COMMAND": command},
            capture_output=True,
            timeout=PATIENCE,
        )
        if done.returncode != 0:
            print(done.stdout.decode(errors="replace")[-3000:], done.stderr.decode(errors="replace")[-3000:])
        return done.returncode

    def start_triggerer(self) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "airflow", "triggerer", "--capacity", "100"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its runner subprocess too, to end them together
        )
        self.triggerers.append(process)
        return process

    def kill_triggerer(self, process: subprocess.Popen) -> None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def stop_triggerers(self) -> None:
        for process in self.triggerers:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def task_state(self, run_id: str) -> str | None:
        code = (
            "from airflow.models.taskinstance import TaskInstance as T\n"
            "from airflow.utils.session import create_session\n"
            "with create_session() as s:\n"
            f"    ti = s.query(T).filter(T.dag_id == 'deferred', T.run_id == {run_id!r}).one_or_none()\n"
            "    print('STATE', ti.state if ti else None)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True).stdout
        match = re.search(r"STATE (\S+)", out)
        return None if match is None or match.group(1) == "None" else match.group(1)

    def mark_failed(self, run_id: str) -> None:
        """What the UI's and REST API's "mark failed" do: the Dag's set_task_instance_state."""
        code = (
            "from airflow.models.dagbag import DBDagBag\n"
            "from airflow.utils.session import create_session\n"
            "from airflow.utils.state import TaskInstanceState\n"
            "with create_session() as s:\n"
            "    dag = DBDagBag().get_latest_version_of_dag('deferred', session=s)\n"
            f"    dag.set_task_instance_state(task_id='t', run_id={run_id!r}, state=TaskInstanceState.FAILED,"
            " session=s)\n"
        )
        subprocess.run([sys.executable, "-c", code], env=self.env, check=True, capture_output=True)

    def wait_state(self, run_id: str, wanted: set[str]) -> str:
        deadline = time.monotonic() + PATIENCE
        state = None
        while time.monotonic() < deadline:
            state = self.task_state(run_id)
            if state in wanted:
                return state
            time.sleep(1)
        pytest.fail(f"the task stayed {state}, never {sorted(wanted)}; logs: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        """Every log file of the instance's task, the triggerers' per-trigger files included, in time order."""
        files = sorted((p for p in self.logs.rglob("*.log*") if p.is_file()), key=lambda p: p.stat().st_mtime)
        return "\n".join(p.read_text(errors="replace") for p in files)

    def trigger_lines(self) -> list[str]:
        """The relayed output lines in the triggerers' per-trigger log files, in the order each wrote them."""
        lines = []
        files = sorted(self.logs.rglob("*.trigger.*"), key=lambda p: p.stat().st_mtime)
        for path in files:
            for raw in path.read_text(errors="replace").splitlines():
                try:
                    event = str(json.loads(raw).get("event", ""))
                except ValueError:
                    continue
                match = re.fullmatch(r"\[(?:stdout|stderr)\] (.*)", event)
                if match:
                    lines.append(match.group(1))
        return lines

    def wait_lines(self, count: int) -> list[str]:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            lines = self.trigger_lines()
            if len(lines) >= count:
                return lines
            time.sleep(0.5)
        pytest.fail(f"only {self.trigger_lines()!r} were relayed; logs: {self.log_text()[-3000:]}")


class DeferredBattery:
    """The cases; see the module docstring for what a subclass gives."""

    backend_code: str = ""
    #: Whether the real-triggerer cases run here; elsewhere (they start Airflow processes of their own)
    #: only with SANDBOX_DEFERRED_ALL_BACKENDS=1 (CI runs the suite twice, and runs them on Docker alone).
    every_case: bool = False
    #: Seconds the long command of the dag.test() case runs (the issue's 60 on Docker; the suite runs twice).
    long_seconds: int = 10

    def sandboxes(self, dag_id: str, run_id: str) -> list[str]:
        raise NotImplementedError

    def every_backend_only(self) -> None:
        if not (self.every_case or os.environ.get("SANDBOX_DEFERRED_ALL_BACKENDS")):
            pytest.skip(
                f"{type(self).__name__}: this case runs on Docker in CI; SANDBOX_DEFERRED_ALL_BACKENDS=1 runs it here"
            )

    @pytest.fixture
    def backend_env(self) -> dict[str, str]:
        return {}

    @pytest.fixture
    def backend(self, backend_env, monkeypatch):
        for name, value in backend_env.items():
            monkeypatch.setenv(name, value)
        scope: dict = {"os": os, "SPEC": None}
        exec(textwrap.dedent(self.backend_code), scope)  # noqa: S102 - the test's own code
        self.spec = scope["SPEC"]
        return scope["BACKEND"]

    @pytest.fixture
    def instance(self, tmp_path, backend_env):
        self.every_backend_only()
        made = Instance(tmp_path / "instance", backend_env, self.backend_code)
        yield made
        made.stop_triggerers()

    # -- under dag.test() ----------------------------------------------------------------------------

    def test_a_long_command_deferred_relays_its_lines_in_order(self, backend, migrated_airflow_db, tmp_path, capfd):
        from airflow.sdk import DAG

        from dag_runs import run_dag_defined_here
        from sandbox_provider.operators.sandbox import SandboxOperator

        out = _open_folder(tmp_path / "out")
        dag_id = f"deferred_{uuid.uuid4().hex[:8]}"
        with DAG(dag_id, schedule=None) as dag:
            SandboxOperator(
                task_id="t",
                backend=backend,
                spec=self.spec,
                command=long_command(self.long_seconds) + '; echo "result $(( 6 * 7 ))" > report.txt',
                exports={"report.txt": f"file://{out}/report.txt"},
                deferrable=True,
                poll_interval=1,
            )
        dag_run = run_dag_defined_here(dag)
        logged = capfd.readouterr()
        text = logged.out + logged.err
        assert [str(ti.state) for ti in dag_run.get_task_instances()] == ["success"], text[-5000:]
        assert "Pausing task as DEFERRED" in text
        relayed = relayed_lines(text)
        assert relayed == [f"line {i}" for i in range(1, 31)] + ["done"], relayed
        xcom = _xcom(dag_run, "t")
        assert xcom["exit_code"] == 0 and xcom["stdout"].endswith("line 29\nline 30\n") and xcom["stderr"] == "done\n"
        assert xcom["exports"] == {"report.txt": f"file://{out}/report.txt"}
        assert (out / "report.txt").read_text() == "result 42\n"
        assert self.sandboxes(dag_id, dag_run.run_id) == []

    def test_a_deferred_run_gives_the_xcom_exports_and_asset_events_of_a_plain_one(
        self, backend, migrated_airflow_db, tmp_path, capfd
    ):
        from airflow.sdk import DAG, Asset

        from dag_runs import asset_events_from, run_dag_defined_here
        from sandbox_provider.operators.sandbox import SandboxOperator

        out = _open_folder(tmp_path / "out")
        for task_id in ("plain", "deferred"):
            _open_folder(out / task_id)
        assets = {task_id: Asset(f"file://{out}/{task_id}/a.txt") for task_id in ("plain", "deferred")}
        command = 'seq 1 3000; echo "to stderr" >&2; mkdir -p d; echo data > d/a.txt; echo more > d/b.txt'
        dag_id = f"deferred_same_{uuid.uuid4().hex[:8]}"
        with DAG(dag_id, schedule=None) as dag:
            for task_id, deferrable in (("plain", False), ("deferred", True)):
                SandboxOperator(
                    task_id=task_id,
                    backend=backend,
                    spec=self.spec,
                    command=command,
                    exports={"d/a.txt": assets[task_id], "d/b.txt": f"file://{out}/{task_id}/b.txt"},
                    max_output_bytes=5000,
                    deferrable=deferrable,
                    poll_interval=1,
                )
        dag_run = run_dag_defined_here(dag)
        states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
        assert states == {"plain": "success", "deferred": "success"}, (states, "".join(capfd.readouterr())[-5000:])
        plain, deferred = _xcom(dag_run, "plain"), _xcom(dag_run, "deferred")
        assert deferred["exports"] == {name: f"file://{out}/deferred/{name[2:]}" for name in ("d/a.txt", "d/b.txt")}
        assert {k: v for k, v in deferred.items() if k != "exports"} == {
            k: v for k, v in plain.items() if k != "exports"
        }
        assert deferred["stdout"].endswith("2999\n3000\n") and deferred["stderr"] == "to stderr\n"
        for name in ("a.txt", "b.txt"):
            assert (out / "deferred" / name).read_text() == (out / "plain" / name).read_text()
        # The export's Asset event, as the plain run emits it (the resumed task's _conclude), its own sandbox's.
        events = asset_events_from(dag_id)
        assert set(events) == {asset.uri for asset in assets.values()}, events
        plain_event, deferred_event = events[assets["plain"].uri], events[assets["deferred"].uri]
        assert deferred_event["handle"] != plain_event["handle"]
        assert {**deferred_event, "handle": None} == {**plain_event, "handle": None}
        assert deferred_event["bytes"] == 5 and deferred_event["sandbox_path"] == "d/a.txt"
        assert self.sandboxes(dag_id, dag_run.run_id) == []

    def test_a_failing_deferred_command_fails_with_its_stderr_tail(self, backend, migrated_airflow_db, capfd):
        from airflow.sdk import DAG

        from dag_runs import run_dag_defined_here
        from sandbox_provider.operators.sandbox import SandboxOperator

        dag_id = f"deferred_fail_{uuid.uuid4().hex[:8]}"
        with DAG(dag_id, schedule=None) as dag:
            SandboxOperator(
                task_id="t",
                backend=backend,
                spec=self.spec,
                command="echo starting; sleep 3; echo 'disk quota exceeded' >&2; exit 3",
                deferrable=True,
                poll_interval=1,
            )
        dag_run = run_dag_defined_here(dag)
        text = "".join(capfd.readouterr())
        assert [str(ti.state) for ti in dag_run.get_task_instances()] == ["failed"], text[-5000:]
        assert re.search(r"exited with status 3 in sandbox \S+\. Last standard error:", text), text[-5000:]
        assert "disk quota exceeded" in text.split("Last standard error:", 1)[1]
        assert self.sandboxes(dag_id, dag_run.run_id) == []

    def test_the_decorator_deferred_returns_the_functions_value(self, backend, migrated_airflow_db, capfd):
        from airflow.sdk import DAG, task

        from dag_runs import run_dag_defined_here

        dag_id = f"deferred_task_{uuid.uuid4().hex[:8]}"
        with DAG(dag_id, schedule=None) as dag:

            @task.sandbox(backend=backend, spec=self.spec, deferrable=True, poll_interval=1)
            def total(values: list) -> dict:
                import time

                time.sleep(2)
                return {"sum": sum(values)}

            total([1, 2, 3])
        dag_run = run_dag_defined_here(dag)
        states = [str(ti.state) for ti in dag_run.get_task_instances()]
        assert states == ["success"], (states, "".join(capfd.readouterr())[-5000:])
        assert _xcom(dag_run, "total") == {"sum": 6}
        assert self.sandboxes(dag_id, dag_run.run_id) == []

    def test_a_deferred_task_on_an_attached_sandbox_leaves_it_to_its_owner(self, backend, migrated_airflow_db, capfd):
        from airflow.sdk import DAG

        from dag_runs import run_dag_defined_here
        from sandbox_provider.operators.sandbox import SandboxOperator

        dag_id = f"deferred_attach_{uuid.uuid4().hex[:8]}"
        handle = "{{ ti.xcom_pull(task_ids='provision') }}"
        with DAG(dag_id, schedule=None) as dag:
            provision = SandboxOperator(
                task_id="provision", backend=backend, spec=self.spec, command="echo 41 > n.txt", keep_sandbox=True
            )
            work = SandboxOperator(
                task_id="work",
                backend=backend,
                attach_to=handle,
                command="sleep 2; echo $(( $(cat n.txt) + 1 ))",
                deferrable=True,
                poll_interval=1,
            )
            check = SandboxOperator(task_id="check", backend=backend, attach_to=handle, command="cat n.txt")
            cleanup = SandboxOperator(
                task_id="cleanup", backend=backend, attach_to=handle, command="true", keep_sandbox=False
            )
            provision >> work >> check >> cleanup
        dag_run = run_dag_defined_here(dag)
        text = "".join(capfd.readouterr())
        states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
        assert set(states.values()) == {"success"}, (states, text[-5000:])
        # The work task really deferred (only it), in the provisioned sandbox, its line relayed by the trigger.
        kept = _xcom(dag_run, "provision")
        assert text.count("Pausing task as DEFERRED") == 1, text[-5000:]
        assert f"Waiting for the command in sandbox {kept} " in text
        assert "42" in relayed_lines(text)
        assert _xcom(dag_run, "work")["stdout"] == "42\n"
        assert _xcom(dag_run, "check")["stdout"] == "41\n"  # the sandbox outlived the deferred task
        assert self.sandboxes(dag_id, dag_run.run_id) == []

    # -- in a real triggerer -------------------------------------------------------------------------

    @pytest.mark.timeout(REAL_RUN_SECONDS)
    def test_in_a_real_triggerer_the_slot_is_free_and_a_killed_triggerer_resumes_without_loss(self, instance, backend):
        self.every_backend_only()
        run_id = f"run_{uuid.uuid4().hex[:8]}"
        # Ten lines, then a wait for the file "go", which the test makes once the first triggerer is killed,
        # then thirty more: however slow the machine, the kill comes in the middle of the command.
        command = (
            'seq -f "line %g" 1 10; n=0; while [ ! -e go ] && [ "$n" -lt 1500 ]; do n=$((n + 1)); sleep 0.2; done; '
            'for i in $(seq 11 40); do echo "line $i"; sleep 0.1; done'
        )
        assert instance.run_try(run_id, command) == 0
        # The task process has exited: no worker slot is held while the command runs.
        assert instance.task_state(run_id) == "deferred"
        [handle] = self.sandboxes("deferred", run_id)

        def in_sandbox(text: str) -> str:
            # As a control program of detached commands runs (run_command would first end the job's processes).
            return backend._job_exec(handle, text, timeout=60)[1].decode()

        first = instance.start_triggerer()
        assert instance.wait_lines(10) == [f"line {i}" for i in range(1, 11)]
        # The relay recorded the ten lines as logged, with nothing in flight (a kill with a batch in flight
        # repeats it under a warning: tests/triggers/test_sandbox_trigger.py), and the command waits.
        logged = sum(len(f"line {i}\n") for i in range(1, 11))
        deadline = time.monotonic() + PATIENCE
        while in_sandbox("cat /tmp/airflow-sandbox-job.*/kept").split() != [str(logged), "0", str(logged), "0"]:
            assert time.monotonic() < deadline, in_sandbox("cat /tmp/airflow-sandbox-job.*/kept")
            time.sleep(0.5)
        instance.kill_triggerer(first)
        assert first.returncode == -signal.SIGKILL  # killed, not shut down: no cleanup ran
        assert instance.trigger_lines() == [f"line {i}" for i in range(1, 11)]
        in_sandbox("touch go")  # the command prints on while no triggerer watches
        instance.start_triggerer()
        instance.wait_state(run_id, {"scheduled", "queued"})
        assert instance.run_try(run_id, command) == 0
        assert instance.task_state(run_id) == "success"
        # Lines 11-40 were printed only after the kill, and the next triggerer relayed them, after the first ten.
        assert instance.trigger_lines() == [f"line {i}" for i in range(1, 41)]
        assert "stopped between logging output and recording it" not in instance.log_text()
        assert self.sandboxes("deferred", run_id) == []

    @pytest.mark.timeout(REAL_RUN_SECONDS)
    def test_a_deferred_task_marked_failed_leaves_nothing(self, instance):
        self.every_backend_only()
        run_id = f"run_{uuid.uuid4().hex[:8]}"
        command = 'for i in $(seq 1 300); do echo "line $i"; sleep 1; done'
        assert instance.run_try(run_id, command) == 0
        assert instance.task_state(run_id) == "deferred"
        assert len(self.sandboxes("deferred", run_id)) == 1
        instance.start_triggerer()
        instance.wait_lines(3)
        instance.mark_failed(run_id)
        deadline = time.monotonic() + PATIENCE
        while self.sandboxes("deferred", run_id) and time.monotonic() < deadline:
            time.sleep(1)
        assert self.sandboxes("deferred", run_id) == [], instance.log_text()[-3000:]
        assert instance.task_state(run_id) == "failed"
        # The trigger ended it: on_kill (Airflow 3.3), or cleanup seeing the task no longer deferred (3.2).
        assert re.search(r"Destroyed sandbox \S+: the task (was marked failed|is failed)", instance.log_text())


def _open_folder(path: Path) -> Path:
    """A folder a sandbox's unprivileged user may export into (the exports run on the worker as it)."""
    path.mkdir()
    path.chmod(0o777)
    return path


def _xcom(dag_run, task_id: str):
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key="return_value")
        ).all()
        return XComModel.deserialize_value(rows[0]) if rows else None
