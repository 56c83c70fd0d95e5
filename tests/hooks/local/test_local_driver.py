"""Starting a bubblewrap command: fresh keyring, filter, env off the command line, cgroup before the first instruction."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from pid_namespace import plain_bwrap
from sandbox_provider.hooks.local import cgroups as _local_cgroups
from sandbox_provider.hooks.local import driver as _local_driver
from sandbox_provider.hooks.local import seccomp as _local_seccomp

pytestmark = pytest.mark.skipif(
    not shutil.which("bwrap") and not os.environ.get("SANDBOX_REQUIRE_BWRAP"), reason="bubblewrap is not installed"
)
TOOLS = {name: shutil.which(name) or f"/usr/bin/{name}" for name in _local_driver.TOOLS}
SANDBOX_UID = 1_900_099_998
BWRAP = [*plain_bwrap(), "--die-with-parent"]


def _uid():
    return SANDBOX_UID if os.geteuid() == 0 else None


def _start(command, *, env=None, rlimits=None, join=None, bwrap=BWRAP):
    return _local_driver.start(
        TOOLS,
        bwrap,
        ["sh", "-c", command] if isinstance(command, str) else command,
        env=env or {},
        rlimits=rlimits or {},
        uid=_uid(),
        join_cgroup=join,
        popen_kwargs={"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE},
    )


def _run(command, **kwargs):
    started = _start(command, **kwargs)
    out, err = bytearray(), bytearray()
    _, status = _local_driver.follow(started, out.extend, err.extend, None, 60, marker_dir=None)
    return status, out.decode(), err.decode()


def test_env_reaches_the_command_whole():
    secret = f"s3cret-{uuid.uuid4().hex}"
    status, out, err = _run('printf "%s|%s|" "$TOKEN" "$MULTI"', env={"TOKEN": secret, "MULTI": "a\nb c=d"})
    assert out == f"{secret}|a\nb c=d|", err
    assert status.get("exit-code") == 0


def test_env_never_in_any_host_command_line_while_it_runs():
    secret = f"s3cret-{uuid.uuid4().hex}"
    started = _start("echo up; sleep 30", env={"TOKEN": secret}, rlimits={"max_processes": 100})
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


def test_both_streams_arrive_whole():
    _, out, err = _run("echo to-out; echo to-err >&2")
    assert out == "to-out\n"
    assert err == "to-err\n"


def test_rlimits_are_set_before_the_command():
    _, out, _ = _run("grep -E '^Max (processes|file size)' /proc/self/limits", rlimits={"max_processes": 77})
    assert "Max processes             77                   77" in out


def test_bwrap_failure_before_its_child_is_reported():
    status, _, err = _run(["true"], bwrap=["bwrap", "--no-such-option"])
    assert "child-pid" not in status
    assert "no-such-option" in err


def test_the_user_is_dropped_in_the_chain_so_the_worker_can_vfork():
    chain = _local_driver.launch_argv(TOOLS, rlimits={"cpu_seconds": 5}, uid=5000)
    assert chain[:3] == [TOOLS["prlimit"], "--cpu=5:5", "--"]
    assert chain[3:7] == [TOOLS["setpriv"], "--reuid=5000", "--regid=5000", "--clear-groups"]
    assert _local_driver.launch_argv(TOOLS, rlimits={}, uid=None) == []
    _, out, _ = _run("id -u; id -G")
    if os.geteuid() == 0:
        assert out.split() == [str(SANDBOX_UID), str(SANDBOX_UID)]


def test_a_launch_has_a_process_group_of_its_own_in_the_workers_session():
    """
    The worker kills a launch by its process group; a new session for it would cost a new scheduler
    autogroup per command. The sandbox's own first process still starts a session of its own.
    """
    sessions = {}
    for bwrap in (BWRAP, [*BWRAP, "--new-session"]):
        started = _start(["sh", "-c", "ps -o sid= -p $$; sleep 30"], bwrap=bwrap)
        try:
            # The session's leader as the sandbox sees it: 0 when it lies outside its PID namespace.
            sessions[len(bwrap)] = int(started.proc.stdout.readline())
            assert os.getpgid(started.proc.pid) == started.proc.pid != os.getpgid(0)
            assert os.getsid(started.proc.pid) == os.getsid(0)
        finally:
            _local_driver.kill_group(started.proc.pid)
            started.proc.communicate()
            os.close(started.status_fd)
    assert sessions[len(BWRAP)] == 0  # the control: without --new-session it is the worker's session
    assert sessions[len(BWRAP) + 1] != 0  # with it (as the backend runs), one begun inside the sandbox


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
        cgroups.remove_parents()


# -- keyrings ------------------------------------------------------------------------------------------

ADD_SECRET = 'keyctl add user airflow-secret "worker-s3cret" @s >/dev/null'
READ_SECRET = "keyctl print %user:airflow-secret; keyctl add user planted x @s; echo rc=$?"


def _allow_all() -> bytes:
    sc = _local_seccomp._binding()
    with tempfile.TemporaryFile() as f:
        sc.SyscallFilter(sc.ALLOW).export_bpf(f)
        f.seek(0)
        return f.read()


def _in_a_worker_with_a_secret(monkeypatch, filtered: bool) -> tuple[str, str]:
    """Fork a "worker" holding a secret in its own session keyring; run READ_SECRET in a sandbox from it."""
    if not filtered:
        monkeypatch.setattr(_local_driver, "filter_program", _allow_all)
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
    drop = f"setpriv --reuid={SANDBOX_UID} --regid={SANDBOX_UID} --clear-groups " if os.geteuid() == 0 else ""
    code = f"{ADD_SECRET}; {drop}{' '.join(BWRAP)} sh -c '{READ_SECRET}'"
    done = subprocess.run(["keyctl", "session", "-", "sh", "-c", code], capture_output=True, text=True)
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


def _keyring_id(text: str) -> str:
    """The session keyring's id in ``keyctl show @s`` output."""
    return text.split("\n")[1].split()[0]


@pytest.mark.skipif(not shutil.which("keyctl"), reason="keyutils is not installed")
def test_every_command_gets_a_keyring_of_its_own_and_the_worker_keeps_its(monkeypatch):
    monkeypatch.setattr(_local_driver, "filter_program", _allow_all)  # to look at the keyring from inside
    mine = subprocess.run(["keyctl", "show", "@s"], capture_output=True, text=True).stdout
    first = _keyring_id(_run("keyctl show @s")[1])
    second = _keyring_id(_run("keyctl show @s")[1])
    assert len({first, second, _keyring_id(mine)}) == 3
    assert subprocess.run(["keyctl", "show", "@s"], capture_output=True, text=True).stdout == mine


def test_a_worker_that_may_not_make_keyrings_says_so_once_and_runs(monkeypatch, caplog):
    import ctypes as _ctypes

    from sandbox_provider.hooks.local import spawner as _local_spawner

    monkeypatch.setattr(_local_spawner, "_keyctl", lambda: (_ctypes.CDLL(None, use_errno=True), 100_000))
    monkeypatch.setattr(_local_spawner, "_warned", False)
    with caplog.at_level("WARNING", logger=_local_spawner.__name__):
        assert _run("echo ran")[1] == "ran\n"
        assert _run("echo ran")[1] == "ran\n"
    assert len([r for r in caplog.records if "may not make kernel keyrings" in r.message]) == 1


def test_a_pipe_grows_only_once_a_read_finds_it_full():
    import fcntl

    read_end, write_end = os.pipe()
    got: list[bytes] = []
    reader = _local_driver.bytes_reader(got.append)
    try:
        os.write(write_end, b"short")
        assert reader(read_end) and got == [b"short"]
        assert fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) == 64 * 1024  # a short output costs no resize
        os.set_blocking(write_end, False)
        written = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                written += os.write(write_end, b"x" * 4096)
        assert reader(read_end) and len(got[-1]) == written == 64 * 1024
        assert fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ) == 1024 * 1024  # a big one: fewer wake-ups from now on
    finally:
        os.close(read_end)
        os.close(write_end)
