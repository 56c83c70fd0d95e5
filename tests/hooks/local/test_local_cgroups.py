"""Per-sandbox cgroups: finding a writable hierarchy, and real limits on this machine's (v1 or v2) cgroups."""

from __future__ import annotations

import errno
import logging
import os
import shlex
import subprocess
import sys
import time
import uuid

import pytest

from sandbox_provider.hooks.local import cgroups as _local_cgroups
from sandbox_provider.hooks.local.cgroups import Cgroups, SandboxLimits, find

MOUNTINFO_V1 = """\
31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / {root}/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / {root}/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
PROC_CGROUP_V1 = "9:name=systemd:/\n8:pids:/\n4:memory:/worker\n1:cpu,cpuacct:/\n0::/\n"


def _tree(base, files):
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_v1_hierarchies_under_the_workers_own_cgroup(tmp_path):
    for sub in ("cpu,cpuacct", "memory/worker", "pids", "systemd"):
        (tmp_path / sub).mkdir(parents=True)
    _tree(tmp_path, {"unified/cgroup.controllers": "hugetlb\n", "unified/cgroup.subtree_control": ""})
    found = find(MOUNTINFO_V1.format(root=tmp_path), PROC_CGROUP_V1)
    assert found is not None and found.version == 1
    assert found.parents == {
        "cpu": f"{tmp_path}/cpu,cpuacct/airflow-sandbox",
        "memory": f"{tmp_path}/memory/worker/airflow-sandbox",
        "pids": f"{tmp_path}/pids/airflow-sandbox",
    }
    # Nothing is made until a sandbox needs it; the hybrid host's unified hierarchy (without the
    # controllers) is left alone.
    assert not os.path.exists(tmp_path / "pids" / "airflow-sandbox")
    assert sorted(os.listdir(tmp_path / "unified")) == ["cgroup.controllers", "cgroup.subtree_control"]
    absolute = find(MOUNTINFO_V1.format(root=tmp_path), PROC_CGROUP_V1, "/sandboxes/airflow")
    assert absolute.parents["memory"] == f"{tmp_path}/memory/sandboxes/airflow"


def test_v2_with_delegated_controllers(tmp_path):
    enabled = "cpu memory pids\n"
    # A delegated v2 tree; the sandboxes' parent exists already (a real cgroupfs fills a new
    # cgroup's control files itself, which plain directories cannot).
    _tree(
        tmp_path,
        {
            "cgroup.controllers": "cpuset cpu io memory pids\n",
            "cgroup.subtree_control": enabled,
            "worker.slice/cgroup.controllers": "cpu memory pids\n",
            "worker.slice/cgroup.subtree_control": enabled,
            "worker.slice/airflow-sandbox/cgroup.controllers": "cpu memory pids\n",
            "worker.slice/airflow-sandbox/cgroup.subtree_control": enabled,
        },
    )
    mountinfo = f"41 31 0:38 / {tmp_path} rw,relatime - cgroup2 cgroup2 rw\n"
    found = find(mountinfo, "0::/worker.slice\n")
    assert found is not None and found.version == 2
    assert set(found.parents.values()) == {f"{tmp_path}/worker.slice/airflow-sandbox"}
    assert set(found.parents) == {"pids", "memory", "cpu"}
    # Without the controllers handed down, v2 is not usable (and v1 is not mounted): None.
    (tmp_path / "worker.slice/airflow-sandbox/cgroup.subtree_control").write_text("")
    (tmp_path / "worker.slice/airflow-sandbox/cgroup.controllers").write_text("")
    assert find(mountinfo, "0::/worker.slice\n") is None


def test_no_hierarchy_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(_local_cgroups, "find", lambda *a, **k: None)
    monkeypatch.setattr(_local_cgroups, "_warned", set())
    _local_cgroups.probe.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=_local_cgroups.__name__):
            assert _local_cgroups.probe("nowhere-1") is None
            _local_cgroups.probe.cache_clear()
            assert _local_cgroups.probe("nowhere-1") is None
        assert len([r for r in caplog.records if "No writable cgroup" in r.message]) == 1
    finally:
        _local_cgroups.probe.cache_clear()


def test_limits_name_their_controllers():
    assert SandboxLimits().needs() == ("pids",)
    assert SandboxLimits(max_processes=5, cpu_cores=0.5).needs() == ("pids", "cpu")
    assert SandboxLimits(memory_bytes=1 << 20).needs() == ("pids", "memory")


# -- the real thing ----------------------------------------------------------------------------------


@pytest.fixture
def cgroups():
    name = f"airflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    found = _local_cgroups.find(open("/proc/self/mountinfo").read(), open("/proc/self/cgroup").read(), name)
    if found is None or set(found.parents) != set(_local_cgroups.CONTROLLERS):
        if os.environ.get("SANDBOX_REQUIRE_CGROUPS"):
            pytest.fail("no writable cgroup hierarchy with pids, memory and cpu")
        pytest.skip("no writable cgroup hierarchy with pids, memory and cpu on this machine")
    yield found
    found.remove_parents()
    for parent in set(found.parents.values()):
        assert not os.path.exists(parent)  # nothing left in it


FORK_UNTIL_REFUSED = """
import os, sys, time
n = 0
while n < 100:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(1)
        time.sleep(60)
        os._exit(0)
    n += 1
print(n, flush=True)
time.sleep(60)
"""


def _spawn_in(cgroups: Cgroups, handle: str, script: str) -> subprocess.Popen:
    # A gate: the child waits on its stdin until it is in the cgroup, like bwrap's --block-fd.
    proc = subprocess.Popen(["sh", "-c", f"read _; {script}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    cgroups.join(handle, proc.pid)
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    return proc


def test_pids_max_binds_one_cgroup_not_its_neighbour(cgroups):
    cgroups.create("a", SandboxLimits(max_processes=10))
    cgroups.create("b", SandboxLimits(max_processes=10))
    try:
        bomb = _spawn_in(cgroups, "a", "exec python3 -c " + shlex.quote(FORK_UNTIL_REFUSED))
        assert int(bomb.stdout.readline()) < 10  # forks were refused at the limit
        assert 8 <= len(cgroups.members("a")) <= 10  # at its limit, and held there
        neighbour = _spawn_in(cgroups, "b", "sleep 0 & wait; echo ok")
        assert neighbour.stdout.read() == b"ok\n"  # the neighbour still forks
        neighbour.wait()
    finally:
        cgroups.remove("a")
        cgroups.remove("b")
    assert bomb.wait() is not None
    assert cgroups.members("a") == []


def test_memory_and_cpu_limits_are_written(cgroups):
    cgroups.create("m", SandboxLimits(memory_bytes=64 * 1024 * 1024, cpu_cores=0.25))
    try:
        memory = os.path.join(cgroups.parents["memory"], "m")
        cpu = os.path.join(cgroups.parents["cpu"], "m")
        if cgroups.version == 2:
            assert open(os.path.join(memory, "memory.max")).read().strip() == str(64 * 1024 * 1024)
            assert open(os.path.join(cpu, "cpu.max")).read().split() == ["25000", "100000"]
        else:
            assert open(os.path.join(memory, "memory.limit_in_bytes")).read().strip() == str(64 * 1024 * 1024)
            assert open(os.path.join(cpu, "cpu.cfs_quota_us")).read().strip() == "25000"
        hog = _spawn_in(cgroups, "m", "exec python3 -c 'b = bytearray(200 * 1024 * 1024); print(len(b))'")
        assert hog.stdout.read() == b""
        assert hog.wait() != 0
        assert cgroups.oom_kills("m") >= 1
    finally:
        cgroups.remove("m")


def test_remove_kills_everything_and_is_idempotent(cgroups):
    cgroups.create("k", SandboxLimits(max_processes=50))
    proc = _spawn_in(cgroups, "k", "for i in 1 2 3 4 5; do sleep 60 & done; echo up; wait")
    assert proc.stdout.readline() == b"up\n"
    started = time.monotonic()
    cgroups.remove("k")
    assert proc.wait(timeout=10) != 0
    assert time.monotonic() - started < 10
    cgroups.remove("k")
    assert not os.path.exists(os.path.join(cgroups.parents["pids"], "k"))
    cgroups.remove_parents()
    cgroups.create("again", SandboxLimits(max_processes=5))  # the parent is made again on demand
    assert os.path.isdir(os.path.join(cgroups.parents["pids"], "again"))
    cgroups.remove_parents()  # not while a sandbox's cgroup is in it
    assert os.path.isdir(os.path.join(cgroups.parents["pids"], "again"))
    cgroups.remove("again")


def test_the_pids_of_a_cgroup_removed_while_read_are_none(cgroups, monkeypatch):
    """A removal (the removal thread's, a sweep's) may take a cgroup between another reader's open and its read."""
    cgroups.create("gone", SandboxLimits(max_processes=5))
    procs = os.path.join(cgroups.parents["pids"], "gone", "cgroup.procs")
    with open(procs, encoding="ascii") as opened:
        cgroups.remove("gone")
        if cgroups.version == 1:  # the control: what such a reader meets on v1
            with pytest.raises(OSError) as err:
                opened.read()
            assert err.value.errno == errno.ENODEV

    def removed_meanwhile(path, *args, **kwargs):
        raise OSError(errno.ENODEV, "No such device", path)

    monkeypatch.setattr(_local_cgroups, "open", removed_meanwhile, raising=False)
    assert _local_cgroups._read_pids(procs) == []


# -- a kill ends the sandbox's processes, never a worker starting a command there --------------------------

#: A "worker": its spawner-like thread moves into the sandbox's cgroup (v1 ``tasks``) and stays there,
#: as the spawner does for the moment it forks; with ``kill``, the worker itself then kills the cgroup.
VISITING_WORKER = """
import contextlib, sys, threading, time
from sandbox_provider.hooks.local import cgroups as mod, spawner
cgroups = mod.Cgroups(version=1, parents=dict(eval(sys.argv[1])), mounts=dict(eval(sys.argv[2])))
inside, leave = threading.Event(), threading.Event()

def visit():
    with getattr(spawner, "placing", None) or contextlib.nullcontext():  # as the spawner holds it
        for enter, back in cgroups.placement("v")():
            with open(enter, "w") as f:
                f.write("0")
        inside.set()
        leave.wait()

threading.Thread(target=visit, daemon=True).start()
if not inside.wait(30):
    sys.exit("the thread did not enter the cgroup within 30 s")
print("inside", flush=True)
sys.stdin.readline()  # the test has seen both processes in the cgroup
if sys.argv[3] == "kill":
    threading.Timer(1.0, leave.set).start()  # the spawn ends; the kill waits for it
    cgroups.kill("v")
    print("survived", flush=True)
"""


def _visiting_worker(cgroups: Cgroups, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            VISITING_WORKER,
            repr(sorted(cgroups.parents.items())),
            repr(sorted(cgroups.mounts.items())),
            mode,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _next_mark(worker: subprocess.Popen) -> str:
    """The worker's next line of its own (Airflow's configuration may log a line first)."""
    for line in worker.stdout:
        if line in ("inside\n", "survived\n"):
            return line
    return f"(ended: {worker.wait(10)})"


@pytest.mark.parametrize("where", ["another worker", "the same worker"])
def test_a_kill_spares_a_worker_whose_spawner_is_in_the_cgroup(cgroups, where):
    if cgroups.version != 1:
        pytest.skip("on cgroup v2 the spawner never enters a sandbox's cgroup (each command's process is moved)")
    cgroups.create("v", SandboxLimits(max_processes=20))
    sandboxed = _spawn_in(cgroups, "v", "echo up; exec sleep 60")
    worker = _visiting_worker(cgroups, "kill" if where == "the same worker" else "wait")
    try:
        assert sandboxed.stdout.readline() == b"up\n"
        assert _next_mark(worker) == "inside\n"
        # The control: the worker is listed among the cgroup's processes, beside the sandbox's own.
        assert {sandboxed.pid, worker.pid} <= set(cgroups.members("v"))
        if where == "another worker":
            cgroups.kill("v")
        worker.stdin.write("go on\n")
        worker.stdin.flush()
        if where == "the same worker":
            assert _next_mark(worker) == "survived\n"
        assert worker.wait(timeout=10) == 0  # not killed
        assert sandboxed.wait(timeout=10) == -9  # the sandbox's process was
    finally:
        for proc in (worker, sandboxed):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cgroups.remove("v")
