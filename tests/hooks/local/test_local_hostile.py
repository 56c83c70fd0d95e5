"""
The local backend against code that tries what hostile code would, each attack shown to work where it
should (a positive control) before it is shown to be stopped.

Most cases need a root worker (per-sandbox users, cgroups, mounts); CI runs as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

from conftest import requires_bwrap
from pid_namespace import plain_bwrap
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.hooks.local import state as _local_state
from sandbox_provider.hooks.local.ids import IdLeases
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG

pytestmark = [
    requires_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="per-sandbox users, cgroups and mounts need a root worker"),
]
BWRAP_PLAIN = plain_bwrap()


def run(hook, handle, command, timeout=60):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=256 * 1024)


def as_user(uid: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv`` on the host as ``uid`` (and the group of the same number), no other groups."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


def has_cgroup(hook, controller: str) -> bool:
    cgroups = hook._cgroups()
    return cgroups is not None and controller in cgroups.parents


@pytest.fixture
def make_hook(tmp_path):
    made = []

    def make(**settings):
        hook = LocalSandboxHook(state_root=str(tmp_path / "state"), uid_lease_dir=str(tmp_path / "ids"), **settings)
        made.append(hook)
        return hook

    yield make
    for hook in made[:1]:
        for kind, handle, _ in _local_state.classify(hook.state_root):
            if kind == "sandbox":
                hook.destroy(handle)


class Background:
    """A command running in a sandbox from a thread; its host pid is found by a unique argv."""

    def __init__(self, hook, handle, seconds: str):
        self.argv = f"sleep {seconds}"
        self.results = []
        self.thread = threading.Thread(target=lambda: self.results.append(run(hook, handle, self.argv, timeout=120)))
        self.thread.start()
        self.pid = self._find()

    def _find(self) -> int:
        needle = self.argv.replace(" ", "\0").encode() + b"\0"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if f.read() == needle:
                            return int(pid)
                except OSError:
                    continue
            time.sleep(0.02)
        raise AssertionError(f"{self.argv!r} never started")

    def join(self):
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


# -- keyrings -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not shutil.which("keyctl"), reason="keyutils is not installed")
def test_the_workers_keyring_is_out_of_reach(make_hook):
    """A secret in the worker's session keyring: unreadable from inside, and nothing can be added to it."""
    hook = make_hook()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker with a keyring of its own, so the test touches no one else's
        try:
            os.close(read_end)
            assert ctypes.CDLL("libkeyutils.so.1").keyctl_join_session_keyring(None) > 0
            subprocess.run(["keyctl", "add", "user", "airflow-secret", "worker-s3cret", "@s"], check=True)
            handle = hook.create()
            attack = run(
                hook,
                handle,
                "keyctl print %user:airflow-secret; echo rc=$?; keyctl add user planted x @s; echo rc=$?; "
                "keyctl add user planted x @u; echo rc=$?; cat /proc/keys; echo end",
            )
            # Positive control: a plain bwrap as the very same user, from the same worker, reads it.
            control = as_user(hook.uid_of(handle), [*BWRAP_PLAIN, "keyctl", "print", "%user:airflow-secret"])
            after = subprocess.run(["keyctl", "show", "@s"], capture_output=True, text=True).stdout
            hook.destroy(handle)
            doc = {"attack": attack.stdout + attack.stderr, "control": control.stdout, "after": after}
            os.write(write_end, json.dumps(doc).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while piece := os.read(read_end, 65536):
        data += piece
    os.close(read_end)
    os.waitpid(pid, 0)
    doc = json.loads(data)
    assert "worker-s3cret" in doc["control"]
    assert "worker-s3cret" not in doc["attack"]
    assert doc["attack"].count("rc=1") == 3 and "end" in doc["attack"]
    assert "airflow-secret" in doc["after"] and "planted" not in doc["after"]


# -- processes ----------------------------------------------------------------------------------------

FORK_AND_HOLD = """
import os, time
n = 0
while n < 500:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    n += 1
open("full", "w").write(str(n))
time.sleep(120)
"""


def test_one_sandbox_at_its_process_limit_does_not_stop_another(make_hook):
    hook = make_hook(max_processes=40)
    a = hook.create()
    hook.write_file(a, "bomb.py", FORK_AND_HOLD.encode())
    results = []
    thread = threading.Thread(target=lambda: results.append(run(hook, a, "python3 bomb.py", timeout=120)))
    thread.start()
    full = os.path.join(hook.state_root, a, "workspace", "full")
    deadline = time.monotonic() + 60
    while not os.path.exists(full) or not open(full).read():
        assert time.monotonic() < deadline, "sandbox A never reached its limit"
        time.sleep(0.05)
    try:
        assert 30 <= int(open(full).read()) < 40  # A is at its limit, and holds it
        # Positive control: under A's user, an RLIMIT_NPROC of 40 (what every sandbox of a root worker
        # shared before) now leaves no room to fork.
        shared = as_user(hook.uid_of(a), ["prlimit", "--nproc=40", "--", "sh", "-c", "sh -c true && echo forked"])
        assert "forked" not in shared.stdout
        b = hook.create()
        fork = "import os; pid = os.fork(); pid or os._exit(0); os.waitpid(pid, 0); print('forked')"
        result = run(hook, b, f"sh -c 'sleep 0 & wait' && python3 -c \"{fork}\"")
        assert result.ok and result.stdout == "forked\n", result
        assert hook.uid_of(a) != hook.uid_of(b)
    finally:
        hook.destroy(a)
        thread.join(timeout=60)
    assert results and results[0].sandbox_terminated


def test_nobody_and_another_sandbox_cannot_read_a_workspace_or_an_environment(make_hook):
    secret = f"s3cret-{uuid.uuid4().hex}"
    hook = make_hook()
    a = hook.create(spec=SandboxSpec(env={"API_TOKEN": secret}))
    b = hook.create()
    hook.write_file(a, "secret.txt", secret.encode())
    command = Background(hook, a, "1234.5")
    try:
        workspace_file = os.path.join(hook.state_root, a, "workspace", "secret.txt")
        environ = f"/proc/{command.pid}/environ"
        # Positive control: the sandbox's own user reads both.
        own = hook.uid_of(a)
        assert as_user(own, ["cat", workspace_file]).stdout == secret
        assert secret in as_user(own, ["cat", environ]).stdout
        for intruder in (65534, hook.uid_of(b)):
            for target in (workspace_file, environ):
                got = as_user(intruder, ["cat", target])
                assert got.returncode != 0 and secret not in got.stdout, (intruder, target)
        # And from inside sandbox B, A's files are not even there.
        assert secret not in run(hook, b, f"cat {workspace_file} 2>&1; ls -la /proc").stdout
        assert oct(os.stat(os.path.join(hook.state_root, a)).st_mode & 0o777) == "0o700"
    finally:
        hook.destroy(a)
        command.join()


def test_ps_never_shows_a_spec_env_value(make_hook):
    secret = f"s3cret-{uuid.uuid4().hex}"
    hook = make_hook()
    a = hook.create(spec=SandboxSpec(env={"API_TOKEN": secret, "OTHER": f"x {secret} y"}))
    command = Background(hook, a, "1234.6")
    try:
        ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True, check=True).stdout
        assert "sleep 1234.6" in ps and "bwrap" in ps  # positive control: ps lists the sandbox's processes
        assert secret not in ps
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert secret.encode() not in f.read()
            except OSError:
                continue
    finally:
        hook.destroy(a)
        command.join()


# -- memory -------------------------------------------------------------------------------------------

FILL_SHM = "head -c 300M /dev/zero > /dev/shm/fill && echo stored; df -k /dev/shm | tail -1"


def test_dev_shm_cannot_outgrow_memory_bytes(make_hook):
    roomy = make_hook(shm_bytes=1 << 30)
    if not has_cgroup(roomy, "memory"):
        pytest.skip("no writable memory cgroup on this machine")
    # Positive control: without a memory limit, 300 MiB go into a 1 GiB /dev/shm.
    handle = roomy.create()
    assert "stored" in run(roomy, handle, FILL_SHM).stdout
    roomy.destroy(handle)
    # The same, with memory_bytes at 128 MiB: the cgroup stops it, although /dev/shm has room.
    limited = make_hook(shm_bytes=1 << 30, memory_bytes=128 * 1024 * 1024)
    handle = limited.create()
    result = run(limited, handle, FILL_SHM)
    assert "stored" not in result.stdout and result.exit_code != 0, result
    limited.destroy(handle)
    # And /dev/shm itself is capped (64 MiB by default), memory limit or not.
    default = make_hook()
    handle = default.create()
    result = run(default, handle, "head -c 100M /dev/zero > /dev/shm/fill && echo stored")
    assert "stored" not in result.stdout and "No space left" in result.stderr
    default.destroy(handle)


def test_disk_bytes_bounds_workspace_and_tmp_together(make_hook):
    hook = make_hook(disk_bytes=8 * 1024 * 1024)
    handle = hook.create()
    try:
        result = run(hook, handle, "head -c 5M /dev/zero > a && head -c 5M /dev/zero > /tmp/b && echo stored")
        assert "stored" not in result.stdout and "No space left" in result.stderr
        assert run(hook, handle, "rm -f /tmp/b; head -c 2M /dev/zero > c && echo stored").stdout.strip() == "stored"
    finally:
        hook.destroy(handle)
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if hook.state_root in line]


# -- removal ------------------------------------------------------------------------------------------

DEEP_TREE = r"""
import os
os.mkdir("deep"); os.chdir("deep")
for i in range(5000):
    os.mkdir("d"); os.chdir("d")
    if i % 500 == 0:
        for name in ("-rf", "with\nnewline", " ", "*"):
            open(name, "w").close()
        os.symlink("/", "root-link")
        os.mkfifo("fifo")
open("bottom", "w").write("x")
os.chdir("/workspace")
os.chmod("deep/d", 0)
os.chmod("deep", 0o500)
print("built")
"""


@pytest.fixture
def state_on_tmpfs(tmp_path):
    """The state root on a tmpfs of its own: removing 5,000 directories from this host's disk takes seconds."""
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0711", "sandbox-test-state", str(state)], check=True)
    yield
    subprocess.run(["umount", "-l", str(state)], check=True)


def test_a_5000_deep_tree_is_destroyed_and_shelters_no_other_expired_sandbox(state_on_tmpfs, make_hook, monkeypatch):
    hook = make_hook()
    deep, other, stuck, kept = (hook.create() for _ in range(4))
    hook.write_file(deep, "tree.py", DEEP_TREE.encode())
    assert run(hook, deep, "python3 tree.py", timeout=120).stdout.strip() == "built"
    tree = os.path.join(hook.state_root, deep, "workspace", "deep")
    # Positive control: the standard library's recursive removal gives up on it.
    with pytest.raises((RecursionError, OSError)):
        shutil.rmtree(tree)
    assert os.path.isdir(tree)
    past = str(int(time.time()) - 10)
    for handle in (deep, other, stuck):
        hook.write_tags(handle, {**hook.read_tags(handle), EXPIRES_AT_TAG: past})
    # One expired sandbox that cannot be removed (its removal fails here) must not stop the others.
    stuck_trash = os.path.join(hook.state_root, _local_state.DESTROYED + stuck)
    real_remove = _local_state.remove_sandbox_dir

    def failing(path):
        if path == stuck_trash:
            raise PermissionError(13, "Permission denied", path)
        real_remove(path)

    monkeypatch.setattr(_local_state, "remove_sandbox_dir", failing)
    report = hook.gc_expired()
    assert sorted(report.removed) == sorted([deep, other])
    assert list(report.failed) == [stuck] and "Permission denied" in report.failed[stuck]
    monkeypatch.setattr(_local_state, "remove_sandbox_dir", real_remove)
    assert hook.gc_expired().removed == [stuck]  # the next sweep finishes it
    assert sorted(os.listdir(hook.state_root)) == [kept]


# -- crashes ------------------------------------------------------------------------------------------


def _leftovers(hook, lease_dir: str) -> list[str]:
    """What is on the host for the sandboxes of ``hook``: directories, leases, cgroups, mounts."""
    found = [f"dir {name}" for name in os.listdir(hook.state_root)]
    found += [f"lease {uid}" for uid in IdLeases(lease_dir, 1, 2).leases()]
    cgroups = hook._cgroups()
    for parent in set(cgroups.parents.values()) if cgroups else ():
        if os.path.isdir(parent):
            found += [f"cgroup {name}" for name in os.listdir(parent) if name.startswith("airflow-sandbox-")]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if hook.state_root in line]
    return found


def test_forty_kills_during_create_and_destroy_leave_nothing_the_next_sweep_misses(make_hook, tmp_path, time_machine):
    # A cgroup parent of its own, so what is counted is this test's alone.
    settings = {
        "disk_bytes": 4 * 1024 * 1024,
        "sandbox_timeout": 600,
        "cgroup_parent": f"sandbox-test-{uuid.uuid4().hex}",
    }
    probe = make_hook()
    if has_cgroup(probe, "memory"):
        settings["memory_bytes"] = 64 * 1024 * 1024
    hook = make_hook(**settings)
    hook.destroy(hook.create())  # the once-per-hook probe, out of the way
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    left_by_a_kill = 0
    for _ in range(40):
        pid = os.fork()
        if pid == 0:  # a worker that does nothing but create and destroy, until it is killed
            try:
                worker = LocalSandboxHook(state_root=hook.state_root, uid_lease_dir=str(tmp_path / "ids"), **settings)
                while True:
                    worker.destroy(worker.create())
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        left_by_a_kill += bool(_leftovers(hook, str(tmp_path / "ids")))
    # Whatever the kills left (interrupted creates and destroys, and whole sandboxes whose worker
    # died), the sweep removes once their grace period or lifetime is over.
    time_machine.move_to(time.time() + 3600, tick=True)
    report = hook.gc_expired()
    assert not report.failed, (seed, report.failed)
    assert _leftovers(hook, str(tmp_path / "ids")) == [], seed
    print(f"seed {seed}: {left_by_a_kill} of 40 kills left something; the sweep removed {len(report.removed)}")
