"""
Guest programs run on the host in a PID namespace of their own (bubblewrap), with the host's system
read-only (:func:`host_view`), for the programs that end processes with ``kill(-1)``: what that reaches is only what the
test started there. Processes are observed from the host, by their PID namespace, so nothing inside can
fake what the test sees. The ``in_namespace`` fixture is registered for every test (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

BWRAP = shutil.which("bwrap")
#: A sleep duration no other process on the host has in its command line (a valid one, so it sleeps).
MARK = f"299.0{os.getpid()}"


#: What of the host a namespace sees, read-only: the system's programs, libraries and settings.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def host_view() -> list[str]:
    """
    bubblewrap options for :data:`SYSTEM` (a link as a link), and an empty ``/tmp``.

    Not the whole root (``--ro-bind / /``): bubblewrap then makes each mount under it read-only in
    turn, and one that goes away meanwhile (a container's overlay as the Engine removes it, a
    sandbox's tmpfs) fails the namespace before its program runs, as CI saw: "Can't bind mount
    /oldroot/ on /newroot/: Unable to apply mount flags: remount .../overlay2/.../merged: Invalid
    argument".
    """
    options = []
    for path in SYSTEM:
        if os.path.islink(path):
            options += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            options += ["--ro-bind", path, path]
    return [*options, "--tmpfs", "/tmp"]


def plain_bwrap() -> list[str]:
    """bubblewrap with new user and PID namespaces, :func:`host_view`, ``/dev`` and ``/proc``: a control's launch."""
    return ["bwrap", "--unshare-user", "--unshare-pid", *host_view(), "--dev", "/dev", "--proc", "/proc"]


class Namespace:
    """One command in a PID namespace of its own; ``pid`` is its host PID."""

    def __init__(self, tmp_path, script: str, *args: str, pid1: bool) -> None:
        (tmp_path / "prog.sh").write_text(script)
        read_fd, write_fd = os.pipe()
        argv = [BWRAP or "bwrap", *host_view(), "--bind", str(tmp_path), str(tmp_path)]
        argv += ["--proc", "/proc", "--dev", "/dev", "--unshare-pid", "--die-with-parent", "--chdir", str(tmp_path)]
        if os.geteuid() != 0:
            argv.append("--unshare-user")
        if pid1:
            argv.append("--as-pid-1")
        argv += ["--info-fd", str(write_fd), "--", "/bin/sh", str(tmp_path / "prog.sh"), *args]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True
        )
        os.close(write_fd)
        with os.fdopen(read_fd) as info:
            self.pid = json.loads(info.read() or "{}").get("child-pid")
        assert self.pid, self.proc.communicate(timeout=10)
        self.ns = os.readlink(f"/proc/{self.pid}/ns/pid")

    def members(self) -> dict[int, tuple[str, str]]:
        """Host PID -> (state, command line) of every live process in the namespace."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != self.ns:
                    continue
                state = process_state(int(entry))
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if state not in (None, "Z"):
                found[int(entry)] = (state, cmdline)
        return found

    def describe_end(self, tmp_path) -> str:
        """What is known of a namespace whose program never reported: to tell who ended it, and how."""
        status = self.proc.poll()
        bwrap_err = b""
        if status is not None:
            bwrap_err = self.proc.communicate(timeout=5)[1]
        files = {}
        for name in ("out", "err"):
            try:
                files[name] = (tmp_path / name).read_text(errors="replace")[-500:]
            except OSError as err:
                files[name] = repr(err)
        return (
            f"at {uptime()} s of uptime, bubblewrap (pid {self.proc.pid}; the namespace's PID 1 is {self.pid}) has "
            f"status {status} (negative: killed by that signal), its stderr {bwrap_err[-500:]!r}; "
            f"members {self.members()}; the program's output {files}"
        )

    def marked(self) -> list[str]:
        return sorted(cmd for _, cmd in self.members().values() if MARK in cmd)

    def zombies(self) -> int:
        count = 0
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == self.ns:
                    count += process_state(int(entry)) == "Z"
            except OSError:
                continue
        return count

    def wait(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(), err.decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=10)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``Z`` ...), or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` is a process that is not a zombie."""
    return process_state(pid) not in (None, "Z")


def uptime() -> str:
    """The seconds since boot, as ``/proc/uptime`` gives them (a kernel trace stamps events the same way)."""
    with open("/proc/uptime", encoding="ascii") as f:
        return f.read().split()[0]


def carries_mark(pid: int, mark: str) -> bool:
    """
    True while ``pid`` is a live process whose environment holds ``mark`` (``NAME=value``, one whole
    entry): a process a test started with that mark, or a descendant that kept it. A pid alone never
    says so: once its process ends, another soon has the number on a busy machine.
    """
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return mark.encode() in environ.split(b"\0") and alive(pid)


def marked_processes(mark: str) -> list[int]:
    """The pids of every live process that :func:`carries_mark` ``mark``."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and carries_mark(int(entry), mark)]


def until(predicate, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    return predicate()


#: PID 1 of a runner's namespace: runs the program given ("$1") with the rest of the arguments, keeps
#: its status and output in files, then stays, so that what the program left behind can be seen.
_RUNNER_HOST = 'p=$1; shift; sh "$p" "$@" > out 2> err; echo $? > rc; exec sleep 60\n'


def run_in_namespace(tmp_path, program: str, *args: str) -> tuple[Namespace, tuple[int, str, str]]:
    (tmp_path / "program.sh").write_text(program)
    ns = Namespace(tmp_path, _RUNNER_HOST, str(tmp_path / "program.sh"), *args, pid1=True)
    rc = tmp_path / "rc"
    assert until(lambda: rc.exists() and rc.read_text().strip(), timeout=30), ns.describe_end(tmp_path)
    return ns, (int(rc.read_text()), (tmp_path / "out").read_text(), (tmp_path / "err").read_text())


@pytest.fixture
def in_namespace(tmp_path):
    started: list[Namespace] = []

    def run(program: str, *args: str) -> tuple[Namespace, tuple[int, str, str]]:
        for name in ("rc", "out", "err"):
            (tmp_path / name).unlink(missing_ok=True)
        ns, result = run_in_namespace(tmp_path, program, *args)
        started.append(ns)
        return ns, result

    yield run
    for ns in started:
        ns.close()
