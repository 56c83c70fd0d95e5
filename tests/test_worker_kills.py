"""
What a task log shows and what is left when a worker dies, with a real supervisor and task process
(``tests/task_process.py``): live output read from the log file while the command runs; the task
process or its supervisor SIGKILLed in the middle of a command; a worker SIGKILLed in the middle of a
200 MB export. The next try must end what the killed one left, and leave no process, container or
partial file of it.
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
from pathlib import Path

import pytest

import task_process
from conftest import requires_bwrap

HARNESS = Path(__file__).with_name("task_process.py")
#: Seconds a step may take on a loaded machine before the test gives up (a bound, not an assertion).
PATIENCE = 120

DAG = """
import io, os, time

from fsspec.implementations.local import LocalFileSystem

from airflow.sdk import DAG
from sandbox_provider.operators.sandbox import SandboxOperator


class _SlowPartial(io.RawIOBase):
    # Storage that takes its time: each write to a .partial file waits a little, the way a remote store
    # does, and once HOLD_EXPORTS_AT bytes are in, it holds the export there (for at most 300 s), so a test
    # can kill the worker in the middle of an export however loaded the machine is.
    def __init__(self, raw):
        self._raw = raw
        self._written = 0

    def writable(self):
        return True

    def write(self, data):
        self._raw.write(data)
        self._raw.flush()
        self._written += len(data)
        time.sleep(0.05)
        if self._written >= int(os.environ.get("HOLD_EXPORTS_AT") or 1 << 62):
            time.sleep(300)
        return len(data)

    def close(self):
        self._raw.close()
        super().close()


class SlowLocal(LocalFileSystem):
    # Not "file": the engine writes a local .partial itself (by descriptor, never through a link), so a
    # store that takes its time must be one the engine treats as remote, writing through its open().
    protocol = ("slowfile",)

    def _open(self, path, mode="rb", **kwargs):
        opened = super()._open(path, mode, **kwargs)
        return _SlowPartial(opened) if "w" in mode and str(path).endswith(".partial") else opened


if os.environ.get("SLOW_EXPORTS"):
    from airflow.sdk.io import attach

    attach("file", fs=SlowLocal(auto_mkdir=True))  # as a remote store, where a "directory" needs no making

BACKEND = os.environ.get("TEST_BACKEND") or None
if BACKEND == "local":
    from sandbox_provider.hooks.local import LocalSandboxHook

    BACKEND = LocalSandboxHook(state_root=os.environ["TEST_STATE_ROOT"])

with DAG("kills", schedule=None):
    SandboxOperator(
        task_id="t",
        backend=BACKEND,
        command=os.environ["TEST_COMMAND"],
        exports={"big": os.environ["TEST_EXPORT"]} if os.environ.get("TEST_EXPORT") else None,
        retries=3,
        timeout=600,
    )
"""


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    """An Airflow instance of its own: home, migrated SQLite database, Dag folder and log folder."""
    root = tmp_path_factory.mktemp("instance")
    env = task_process.instance(root, TEST_STATE_ROOT=str(root / "state"))
    (root / "dags" / "kills.py").write_text(textwrap.dedent(DAG))
    return root, env


class Try:
    """One try of ``kills.t``, started in its own supervisor process."""

    def __init__(self, instance, run_id: str, try_number: int, *, as_worker: bool = False, **env: str):
        root, base = instance
        self.log = root / "logs" / run_id / f"{try_number}.log"
        self.pid_file = Path(str(self.log) + ".pid")
        #: With ``as_worker``: the standard error of the worker process the supervisor runs under.
        self.worker_log = root / f"{run_id}-{try_number}.worker.log"
        if as_worker:
            env = {**env, "TASK_PROCESS_WORKER_LOG": str(self.worker_log)}
        self._env = env
        self.supervisor = subprocess.Popen(
            [sys.executable, str(HARNESS), str(root / "dags" / "kills.py"), "kills", "t", run_id, str(try_number)]
            + [os.path.relpath(self.log, root / "logs")],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def events(self) -> list[str]:
        if not self.log.exists():
            return []
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                found.append(str(json.loads(line).get("event", "")))
            except ValueError:
                continue
        return found

    def failure(self) -> list[str]:
        """The messages of the exception the task failed with, its causes included, as its log records them."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines() if self.log.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "Task failed with exception":
                found += [str(detail.get("exc_value")) for detail in record.get("error_detail") or []]
        return found

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            for event in self.events():
                match = re.search(pattern, event)
                if match:
                    return match
            if self.supervisor.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"{pattern!r} never reached the log; it holds {self.events()!r}; output: {self.output()}")

    def supervisor_pid(self) -> int:
        """The supervisor's pid: the harness itself, or its child when it stays as the worker."""
        marker = Path(str(self.worker_log) + ".supervisor")
        deadline = time.monotonic() + PATIENCE
        while "TASK_PROCESS_WORKER_LOG" in self._env and not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return int(marker.read_text()) if marker.exists() else self.supervisor.pid

    def task_pid(self) -> int:
        deadline = time.monotonic() + PATIENCE
        while not self.pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return int(self.pid_file.read_text())

    def finish(self) -> int:
        try:
            return self.supervisor.wait(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            self.supervisor.kill()
            pytest.fail(f"the try did not end; output: {self.output()}")

    def output(self) -> str:
        if self.supervisor.poll() is None or self.supervisor.stdout is None:
            return "(still running)"
        return self.supervisor.stdout.read().decode(errors="replace")[-3000:]


def wait_gone(pid: int) -> None:
    import psutil

    try:
        psutil.Process(pid).wait(timeout=PATIENCE)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        pytest.fail(f"process {pid} is still running")


def processes_of(handle: str) -> list[str]:
    """Command lines of the host's processes that belong to a local sandbox (they name its directory)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(handle in part for part in proc.info["cmdline"]):
                found.append(" ".join(proc.info["cmdline"]))
        except (psutil.Error, TypeError):
            continue
    return found


BACKENDS = [pytest.param("local", marks=requires_bwrap), pytest.param("docker", marks=pytest.mark.docker), "kubernetes"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The TEST_BACKEND value for the Dag, and a function telling whether a sandbox of it still runs."""
    if request.param == "local":
        state = Path(request.getfixturevalue("instance")[1]["TEST_STATE_ROOT"])
        return {"TEST_BACKEND": "local"}, lambda handle: processes_of(handle) or (state / handle).exists()
    if request.param == "kubernetes":
        conn = request.getfixturevalue("kubernetes_conn")
        core = request.getfixturevalue("kubernetes_cluster")
        namespace = request.getfixturevalue("kubernetes_namespace")

        def pods(handle):
            found = core.list_namespaced_pod(namespace, field_selector=f"metadata.name={handle}").items
            return [p.metadata.name for p in found if p.metadata.deletion_timestamp is None]

        return {"TEST_BACKEND": conn, f"AIRFLOW_CONN_{conn.upper()}": os.environ[f"AIRFLOW_CONN_{conn.upper()}"]}, pods
    conn = request.getfixturevalue("docker_conn")
    client = request.getfixturevalue("docker_client")

    def containers(handle):
        return [
            c.name
            for c in client.containers.list(all=True, ignore_removed=True, filters={"name": handle})
            if c.name == handle
        ]

    return {
        "TEST_BACKEND": conn,
        f"AIRFLOW_CONN_{conn.upper()}": os.environ[f"AIRFLOW_CONN_{conn.upper()}"],
    }, containers


# -- live output -------------------------------------------------------------------------------------------


def test_output_reaches_the_log_while_the_command_runs_and_stays_when_killed(instance, backend, request):
    env, _ = backend
    run = f"live-{request.node.callspec.id}"
    first = Try(instance, run, 1, TEST_COMMAND="for i in 1 2 3; do echo line $i; sleep 20; done", **env)
    first.wait_for(r"^\[stdout\] line 1$")
    assert first.supervisor.poll() is None  # the task is still running
    assert not any("exited with status" in e or "line 3" in e for e in first.events())
    os.kill(first.task_pid(), signal.SIGTERM)  # how Airflow kills a task: on_kill destroys the sandbox
    first.finish()
    events = first.events()
    assert "[stdout] line 1" in events
    assert any(re.match(r"Task killed: destroyed sandbox airflow-sandbox-", e) for e in events), events
    # The failure names the stop, and nothing in it (causes included) blames the image or the sandbox's keeper.
    failure = first.failure()
    assert failure and "the task was stopped while it ran" in failure[0], failure
    assert not any("image" in message or "keeper" in message for message in failure), failure


# -- retries after a killed worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["task process", "supervisor"])
def test_the_next_try_ends_what_a_killed_try_left(instance, backend, victim, request):
    env, still_there = backend
    run = f"kill-{request.node.callspec.id}".replace(" ", "-")
    first = Try(instance, run, 1, TEST_COMMAND="echo started; sleep 600", as_worker=victim == "supervisor", **env)
    handle = first.wait_for(r"^Provisioned sandbox (airflow-sandbox-[0-9a-f]+)").group(1)
    first.wait_for(r"^\[stdout\] started$")
    task_pid = first.task_pid()
    assert still_there(handle)  # positive control: the command is running in the sandbox
    if victim == "task process":
        os.kill(task_pid, signal.SIGKILL)
        first.finish()
    else:
        os.kill(first.supervisor_pid(), signal.SIGKILL)
        first.finish()
        # The orphaned task process notices its supervisor is gone, ends the sandbox and exits: it
        # does not run on beside the next try until the command's own timeout.
        wait_gone(task_pid)
        assert not still_there(handle), f"sandbox {handle} outlived its task process"
        # The task log's relay died with the supervisor: the worker that started it heard why, in its own log.
        said = first.worker_log.read_text(errors="replace")
        assert f"The supervisor (pid {first.supervisor_pid()}) of task kills/{run}/t exited" in said, said
        assert f"sandbox {handle}" in said and "the sandbox is destroyed" in said, said
    second = Try(instance, run, 2, TEST_COMMAND="echo second", **env)
    second.wait_for(r"^\[stdout\] second$")
    assert not still_there(handle), f"try 1's sandbox {handle} still runs beside try 2"
    assert second.finish() == 0, second.output()
    events = second.events()
    ended = f"Ended sandbox {handle} on backend {request.node.callspec.params['backend']}"
    if victim == "task process":
        # Nothing of try 1 could clean up: try 2 found its sandbox by its stamps and ended it.
        assert any(e.startswith(ended) and "try 1 of this task" in e for e in events), events
    else:
        # Try 1's task process ended its own sandbox when its supervisor went; try 2 looked and says so.
        assert any("no earlier try of this task left a sandbox running" in e for e in events), events


# -- a worker killed in the middle of an export --------------------------------------------------------------


@requires_bwrap
def test_a_worker_killed_mid_export_leaves_no_partial_after_the_next_export(instance, tmp_path):
    out = tmp_path / "out"
    destination = out / "big.bin"
    held = 20 * 1024 * 1024  # the export of try 1 holds once this much is written, until the kill
    env = {
        "TEST_BACKEND": "local",
        "TEST_EXPORT": destination.as_uri(),
        "SLOW_EXPORTS": "1",
        "HOLD_EXPORTS_AT": str(held),
    }
    first = Try(instance, "export", 1, TEST_COMMAND="head -c 200M /dev/zero > big", **env)
    deadline = time.monotonic() + PATIENCE
    partials: list[Path] = []
    while time.monotonic() < deadline:
        partials = [p for p in out.glob("big.bin.*.partial")] if out.exists() else []
        if partials and partials[0].stat().st_size >= held:
            break
        assert first.supervisor.poll() is None, first.output()
        time.sleep(0.05)
    else:
        pytest.fail(f"within {PATIENCE} s, the export of try 1 never wrote {held} bytes: {partials}")
    os.kill(first.task_pid(), signal.SIGKILL)
    first.finish()
    assert [p.name for p in out.iterdir()] == [partials[0].name]  # the kill left a partial: positive control
    assert held <= partials[0].stat().st_size < 200 * 1024 * 1024
    assert re.fullmatch(r"big\.bin\.airflow-[0-9a-f]{12}-1\.partial", partials[0].name)

    second = Try(instance, "export", 2, TEST_COMMAND="echo done > big", **env)
    assert second.finish() == 0, second.output()
    assert sorted(p.name for p in out.iterdir()) == ["big.bin"]
    assert destination.read_text() == "done\n"
    assert any(e.startswith(f"Removed {partials[0].as_uri()}") and "try 1" in e for e in second.events())
