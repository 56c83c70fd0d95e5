"""
Plain functions behind ``LocalSandboxHook``: the bubblewrap command line, process plumbing and
state files. No policy lives here; the hook decides what to run and with which limits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

#: The environment bwrap itself starts with (it is visible as /proc/1/environ in the sandbox).
BWRAP_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
#: Where a workspace may not be mounted: the system directories shown to the sandbox, and its own mounts.
RESERVED_WORKDIRS = (
    "/",
    "/tmp",
    "/proc",
    "/dev",
    "/sys",
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc entries programs need to start and to find users, certificates and time zones. Nothing
# else of /etc is shown: it can hold credentials and the worker's configuration.
ETC_ENTRIES = (
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "protocols",
    "services",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "mime.types",
    "os-release",
    "debian_version",
    "lsb-release",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
)
NETWORK_ETC = ("resolv.conf", "gai.conf")


def bind_or_link(source: str, dest: str) -> list[str]:
    if os.path.islink(source):
        return ["--symlink", os.readlink(source), dest]
    if os.path.exists(source):
        return ["--ro-bind", source, dest]
    return []


def write_json(path: str, data: Mapping[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def remove_tree(path: str) -> None:
    """Remove a sandbox directory, even one whose code made its files unreadable or unwritable."""

    def fix(func, target, _exc):
        # The sandbox may have chmodded a directory to 0; give it back to ourselves and retry.
        parent = os.path.dirname(target)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
        with contextlib.suppress(OSError):
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
        try:
            func(target)
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno == errno.ENOTEMPTY or (func is os.rmdir and os.path.isdir(target)):
                shutil.rmtree(target, onerror=fix)
            else:
                raise

    shutil.rmtree(path, onerror=fix)


def bytes_reader(callback: Callable[[bytes], None]) -> Callable[[int], bool]:
    """A pipe reader for :func:`pump` that hands each piece read to ``callback``."""

    def read(fd: int) -> bool:
        try:
            data = os.read(fd, 1024 * 1024)
        except BlockingIOError:
            return True
        if data:
            callback(data)
        return bool(data)

    return read


def local_file_fd(stream: IO[bytes]) -> int | None:
    """The descriptor of ``stream`` if it is a regular local file with nothing buffered, else None."""
    try:
        stream.flush()
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def pump(proc: subprocess.Popen, readers: dict[Any, Callable[[int], bool]], budget: float) -> bool:
    """
    Drain the process's pipes with their readers (each returns False at end of file) until it
    exits and they close, or ``budget`` seconds pass; then kill its process group. Return whether
    the deadline was hit.

    One thread and one selector: no polling, so a short command costs no added latency.
    """
    deadline = time.monotonic() + budget
    timed_out = False
    pidfd = os.pidfd_open(proc.pid)
    grace: float | None = None
    with selectors.DefaultSelector() as selector:
        for pipe, reader in readers.items():
            os.set_blocking(pipe.fileno(), False)
            with contextlib.suppress(OSError):  # bigger pipes: fewer wake-ups on large outputs
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, 1024 * 1024)
            selector.register(pipe.fileno(), selectors.EVENT_READ, reader)
        selector.register(pidfd, selectors.EVENT_READ, None)
        open_pipes = len(readers)
        exited = False
        try:
            while open_pipes or not exited:
                now = time.monotonic()
                limit = grace if grace is not None else deadline
                if now >= limit:
                    if grace is not None:
                        break  # the process is gone; stop waiting for pipes a stray holder keeps open
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    grace = now + 10
                    continue
                for key, _ in selector.select(timeout=limit - now):
                    if key.data is None:
                        selector.unregister(pidfd)
                        exited = True
                        if grace is None:
                            grace = time.monotonic() + 10
                        continue
                    if not key.data(key.fd):
                        selector.unregister(key.fd)
                        open_pipes -= 1
        finally:
            os.close(pidfd)
    if timed_out or not exited:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in readers:
        pipe.close()
    return timed_out


def read_status(fd: int) -> dict[str, Any]:
    """Merge the JSON documents bwrap wrote to its status pipe (``child-pid``, ``exit-code``)."""
    data = b""
    try:
        while True:
            piece = os.read(fd, 65536)
            if not piece:
                break
            data += piece
    finally:
        os.close(fd)
    status: dict[str, Any] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                status.update(doc)
    return status


def feed(pipe: IO[bytes], source: IO[bytes]) -> threading.Thread:
    def copy() -> None:
        try:
            while True:
                data = source.read(1024 * 1024)
                if not data:
                    break
                pipe.write(data)
        except (BrokenPipeError, OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()

    thread = threading.Thread(target=copy, daemon=True, name="sandbox-import")
    thread.start()
    return thread


class CountingReader:
    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._source.read(n)
        self.count += len(data)
        return data


def base_env(workdir: str) -> dict[str, str]:
    """The environment every command starts from; ``spec.env`` goes on top."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
    }


def bwrap_argv(
    bwrap: str,
    *,
    path: str,
    workdir: str,
    image: str | None,
    network: bool,
    env: Mapping[str, str],
    status_fd: int,
) -> list[str]:
    """
    The bubblewrap command line for one command in the sandbox directory ``path``: new user, PID,
    IPC, UTS and (unless ``network``) network namespaces, no capabilities, the system directories
    (or ``image``) read-only, the workspace at ``workdir``, its own ``/tmp``, a clean environment.
    """
    args = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--json-status-fd",
        str(status_fd),
        "--share-net" if network else "--unshare-net",
    ]
    if image:
        for entry in sorted(os.listdir(image)):
            if entry in ("proc", "dev", "tmp", "sys") or "/" + entry == workdir:
                continue
            args += bind_or_link(os.path.join(image, entry), "/" + entry)
    else:
        for directory in SYSTEM_DIRS:
            args += bind_or_link(directory, directory)
        for entry in ETC_ENTRIES + (NETWORK_ETC if network else ()):
            args += bind_or_link(os.path.join("/etc", entry), "/etc/" + entry)
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", os.path.join(path, "tmp"), "/tmp"]
    args += ["--bind", os.path.join(path, "workspace"), workdir, "--remount-ro", "/", "--chdir", workdir, "--clearenv"]
    for key, value in {**base_env(workdir), **env}.items():
        args += ["--setenv", key, value]
    return args


def prlimit_argv(limits: Mapping[str, int | None]) -> list[str]:
    """
    The ``prlimit`` prefix setting ``limits`` (``cpu``, ``as``, ``nproc``, ``fsize``; None for none),
    or an empty list when none is set.

    :raises FileNotFoundError: when limits are asked for and util-linux's ``prlimit`` is missing.
    """
    flags = [f"--{name}={int(value)}" for name, value in limits.items() if value]
    if not flags:
        return []
    prlimit = shutil.which("prlimit")
    if not prlimit:
        raise FileNotFoundError("prlimit")
    return [prlimit, *flags, "--"]


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads, if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_marked(path: str) -> None:
    """Kill every command still running in the sandbox directory ``path`` (its ``run-<pid>`` markers)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if not name.startswith("run-") or not name[4:].isdigit():
                continue
            pid = int(name[4:])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if path.encode() in cmdline:  # the process is still this sandbox's bwrap, not a reused pid
                kill_group(pid)
