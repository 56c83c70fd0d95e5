"""Starting a bubblewrap command: fresh keyring, filter, env off the command line, cgroup before the first instruction."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from sandbox_provider.hooks import _local_cgroups, _local_launch, _local_seccomp

pytestmark = pytest.mark.skipif(
    not shutil.which("bwrap") and not os.environ.get("SANDBOX_REQUIRE_BWRAP"), reason="bubblewrap is not installed"
)
KEYCTL = shutil.which("keyctl") or "/usr/bin/keyctl"
PRLIMIT = shutil.which("prlimit") or "/usr/bin/prlimit"
SANDBOX_UID = 1_900_099_998
BWRAP = ["bwrap", "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
BWRAP += ["--tmpfs", "/tmp", "--die-with-parent"]


def _identity():
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def _run(command, *, env=None, rlimits=None, join=None):
    started = _local_launch.start(
        KEYCTL,
        PRLIMIT,
        BWRAP,
        ["sh", "-c", command],
        env=env or {},
        rlimits=rlimits or {},
        join_cgroup=join,
        popen_kwargs={"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, **_identity()},
    )
    out, err = started.proc.communicate(timeout=60)
    rest = b""
    while piece := os.read(started.status_fd, 65536):
        rest += piece
    os.close(started.status_fd)
    started.status.update(_local_launch.read_status_docs(rest))
    return started, out.decode(), (started.stderr_head + err).decode()


def test_env_reaches_the_command_whole():
    secret = f"s3cret-{uuid.uuid4().hex}"
    started, out, err = _run('printf "%s|%s|" "$TOKEN" "$MULTI"', env={"TOKEN": secret, "MULTI": "a\nb c=d"})
    assert out == f"{secret}|a\nb c=d|", err
    assert started.status.get("exit-code") == 0


def test_env_never_in_any_host_command_line_while_it_runs():
    secret = f"s3cret-{uuid.uuid4().hex}"
    started = _local_launch.start(
        KEYCTL,
        PRLIMIT,
        BWRAP,
        ["sh", "-c", "echo up; sleep 30"],
        env={"TOKEN": secret},
        rlimits={"max_processes": 100},
        join_cgroup=None,
        popen_kwargs={"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, **_identity()},
    )
    try:
        assert started.proc.stdout.readline() == b"up\n"
        ps = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True, check=True).stdout
        assert "sleep 30" in ps  # positive control: the sandbox's processes are listed
        assert secret not in ps
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert secret.encode() not in f.read()
            except OSError:
                continue
    finally:
        started.proc.kill()
        started.proc.communicate()
        os.close(started.status_fd)


def test_keyctl_note_is_dropped_and_stderr_kept():
    _, out, err = _run("echo to-out; echo to-err >&2")
    assert out == "to-out\n"
    assert err == "to-err\n"


def test_rlimits_are_set_before_the_command():
    _, out, _ = _run("grep -E '^Max (processes|file size)' /proc/self/limits", rlimits={"max_processes": 77})
    assert "Max processes             77                   77" in out


def test_bwrap_failure_before_its_child_is_reported():
    started = _local_launch.start(
        KEYCTL,
        PRLIMIT,
        ["bwrap", "--no-such-option"],
        ["true"],
        env={},
        rlimits={},
        join_cgroup=None,
        popen_kwargs={"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, **_identity()},
    )
    _, err = started.proc.communicate(timeout=30)
    os.close(started.status_fd)
    assert "child-pid" not in started.status
    assert b"no-such-option" in started.stderr_head + err
    assert started.proc.returncode != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need a root worker here")
def test_the_first_instruction_already_runs_in_the_cgroup():
    name = f"airflow-sandbox-test-{uuid.uuid4().hex[:8]}"
    cgroups = _local_cgroups.find(open("/proc/self/mountinfo").read(), open("/proc/self/cgroup").read(), name)
    if cgroups is None or "pids" not in cgroups.parents:
        pytest.skip("no writable pids cgroup")
    cgroups.create("h", _local_cgroups.SandboxLimits(max_processes=30))
    try:
        _, out, err = _run("cat /proc/self/cgroup", join=lambda pid: cgroups.join("h", pid))
        pids_line = [line for line in out.splitlines() if ":pids:" in line or line.startswith("0::")]
        assert pids_line and pids_line[0].endswith(f"{name}/h"), (out, err)
    finally:
        cgroups.remove("h")
        for parent in set(cgroups.parents.values()):
            os.rmdir(parent)


# -- keyrings ------------------------------------------------------------------------------------------

ADD_SECRET = 'keyctl add user airflow-secret "worker-s3cret" @s >/dev/null'
READ_SECRET = "keyctl print %user:airflow-secret; keyctl add user planted x @s; echo rc=$?"


def _allow_all_fd() -> int:
    sc = _local_seccomp._binding()
    with tempfile.TemporaryFile() as f:
        sc.SyscallFilter(sc.ALLOW).export_bpf(f)
        f.seek(0)
        program = f.read()
    fd = os.memfd_create("allow-all", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _in_a_worker_with_a_secret(monkeypatch, filtered: bool) -> tuple[str, str]:
    """Fork a "worker" holding a secret in its own session keyring; run READ_SECRET in a sandbox from it."""
    if not filtered:
        monkeypatch.setattr(_local_launch, "seccomp_fd", _allow_all_fd)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            libkeyutils = ctypes.CDLL("libkeyutils.so.1")
            assert libkeyutils.keyctl_join_session_keyring(None) > 0
            subprocess.run(["sh", "-c", ADD_SECRET], check=True)
            _, out, _ = _run(READ_SECRET)
            after = subprocess.run(["keyctl", "show", "@s"], capture_output=True, text=True).stdout
            os.write(write_end, (out + "\0" + after).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while piece := os.read(read_end, 65536):
        data += piece
    os.close(read_end)
    os.waitpid(pid, 0)
    out, after = data.decode().split("\0")
    return out, after


@pytest.mark.skipif(not shutil.which("keyctl"), reason="keyutils is not installed")
def test_positive_control_plain_bwrap_reads_the_workers_keyring():
    code = f"{ADD_SECRET}; {' '.join(BWRAP)} sh -c '{READ_SECRET}'"
    done = subprocess.run(["keyctl", "session", "-", "sh", "-c", code], capture_output=True, text=True, **_identity())
    assert "worker-s3cret" in done.stdout  # the attack works without the new session keyring
    assert "rc=0" in done.stdout


@pytest.mark.skipif(not shutil.which("keyctl"), reason="keyutils is not installed")
def test_a_fresh_session_keyring_even_without_the_filter(monkeypatch):
    out, after = _in_a_worker_with_a_secret(monkeypatch, filtered=False)
    assert "worker-s3cret" not in out
    assert "rc=0" in out  # the key went into the sandbox's own keyring...
    assert "airflow-secret" in after and "planted" not in after  # ...not the worker's


@pytest.mark.skipif(not shutil.which("keyctl"), reason="keyutils is not installed")
def test_keyring_calls_refused_by_the_filter(monkeypatch):
    out, after = _in_a_worker_with_a_secret(monkeypatch, filtered=True)
    assert "worker-s3cret" not in out
    assert "rc=1" in out
    assert "airflow-secret" in after and "planted" not in after
