"""
Plain functions behind ``LocalSandboxHook``: the bubblewrap command line, starting a command and
process plumbing. No policy lives here; the hook decides what to run and with which limits.

What has to be in place before a sandboxed program runs its first instruction, and how
:func:`start` puts it there:

- a fresh, empty session keyring of its own (``spawner.py``: the worker's keyrings are out of
  reach; the system-call filter refuses the keyring calls on top);
- the system-call filter (``seccomp.py``), handed to ``bwrap --seccomp`` as a descriptor;
- ``spec.env``, handed over through ``bwrap --args`` as a descriptor, so no value appears in any
  process's command line;
- the sandbox's cgroup: ``bwrap --block-fd`` holds the sandbox's first process after its
  namespaces are built and before it runs anything; the worker reads that process's pid from the
  JSON status, puts it into the cgroup, then lets it go. Everything the command starts stays in it;
- resource limits, set by util-linux's ``prlimit`` on itself before it runs ``bwrap`` (setting
  another process's limits would need ``CAP_SYS_RESOURCE``, which a root worker may not hold).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import selectors
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from sandbox_provider.hooks.local.seccomp import filter_program
from sandbox_provider.hooks.local.spawner import Placement, spawn
from sandbox_provider.sandbox.spec import check_workdir

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


#: A pipe's default capacity: a read that fills it means the output is a big one.
_PIPE_DEFAULT = 64 * 1024
_PIPE_BIG = 1024 * 1024


def bytes_reader(callback: Callable[[bytes], None]) -> Callable[[int], bool]:
    """
    A pipe reader for :func:`pump` that hands each piece read to ``callback``. The first time a read
    finds the pipe full, the pipe grows to 1 MiB: fewer wake-ups for a large output, and nothing
    spent on the many short ones.
    """
    grown = [False]

    def read(fd: int) -> bool:
        try:
            data = os.read(fd, _PIPE_BIG)
        except BlockingIOError:
            return True
        if data:
            if len(data) >= _PIPE_DEFAULT and not grown[0]:
                grown[0] = True
                with contextlib.suppress(OSError):
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BIG)
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
    """Read bwrap's status pipe to its end and close it; merge its JSON documents."""
    data = b""
    try:
        while piece := os.read(fd, 65536):
            data += piece
    finally:
        os.close(fd)
    return status_docs(data)


def status_docs(data: bytes) -> dict[str, Any]:
    """Merge the JSON documents of bwrap's status, one a line (``child-pid``, ``exit-code``...)."""
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


def system_binds(image: str | None, workdir: str, network: bool) -> list[str]:
    """
    The read-only mounts of the system: the host's system directories and a short list of ``/etc``
    entries (the network ones too when ``network``), or every entry of the root filesystem ``image``.
    """
    args: list[str] = []
    if image:
        for entry in sorted(os.listdir(image)):
            if entry in ("proc", "dev", "tmp", "sys") or "/" + entry == workdir:
                continue
            args += bind_or_link(os.path.join(image, entry), "/" + entry)
        return args
    for directory in SYSTEM_DIRS:
        args += bind_or_link(directory, directory)
    for entry in ETC_ENTRIES + (NETWORK_ETC if network else ()):
        args += bind_or_link(os.path.join("/etc", entry), "/etc/" + entry)
    return args


def bwrap_argv(
    bwrap: str,
    *,
    box: str,
    workdir: str,
    binds: Sequence[str],
    network: bool,
    shm_bytes: int,
) -> list[str]:
    """
    The bubblewrap options for one command in the sandbox whose own files are in ``box``: new user,
    PID, IPC, UTS, cgroup and (unless ``network``) network namespaces, no capabilities, the
    ``binds`` of :func:`system_binds` read-only, the workspace at ``workdir``, its own ``/tmp``, a
    ``/dev/shm`` of ``shm_bytes``, an empty environment (the caller hands over the one to set).
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
        "--share-net" if network else "--unshare-net",
        *binds,
    ]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(shm_bytes)), "--tmpfs", "/dev/shm"]
    args += ["--bind", os.path.join(box, "tmp"), "/tmp", "--bind", os.path.join(box, "workspace"), workdir]
    args += ["--remount-ro", "/", "--chdir", workdir, "--clearenv"]
    return args


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads, if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_marked(path: str, match: str | None = None) -> None:
    """
    Kill every command still running in the sandbox directory ``path`` (its ``run-<pid>`` markers),
    checking that each pid is still a bwrap of the sandbox once at ``match`` (default ``path``).
    """
    needle = (match or path).encode()
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
            if needle in cmdline:  # the process is still this sandbox's bwrap, not a reused pid
                kill_group(pid)


# -- starting a command ----------------------------------------------------------------------------

#: Limit names the launcher understands -> the ``prlimit`` option that sets that kernel resource limit.
RLIMITS = {
    "cpu_seconds": "--cpu",  # RLIMIT_CPU, seconds of CPU per process
    "max_processes": "--nproc",  # RLIMIT_NPROC, processes of the user
    "max_file_bytes": "--fsize",  # RLIMIT_FSIZE, bytes per file written
    "address_space_bytes": "--as",  # RLIMIT_AS, bytes of address space per process
}
#: The programs a command starts through, and the packages that have them.
TOOLS = {
    "prlimit": "util-linux (apt-get install util-linux)",
    "setpriv": "util-linux (apt-get install util-linux)",
}


def env_args(env: Mapping[str, str]) -> bytes:
    """``--setenv NAME VALUE`` for each entry, NUL-separated, as ``bwrap --args`` reads them."""
    parts: list[bytes] = []
    for key, value in env.items():
        parts += [b"--setenv", key.encode(), value.encode()]
    return b"".join(part + b"\0" for part in parts)


def memfd(name: str, data: bytes) -> int:
    """A new anonymous memory file holding ``data``, positioned at its start (close-on-exec)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Started:
    """A running command: ``proc`` (stderr always a pipe), ``status_fd`` (bwrap's JSON status, unread part)
    and ``status`` (what was read of it while starting)."""

    proc: subprocess.Popen
    status_fd: int
    status: dict[str, Any] = field(default_factory=dict)


def rlimit_argv(prlimit: str, limits: Mapping[str, int]) -> list[str]:
    """``prlimit`` with hard and soft limits for ``limits`` (names of :data:`RLIMITS`), or [] for none."""
    if not limits:
        return []
    return [prlimit, *(f"{RLIMITS[name]}={value}:{value}" for name, value in limits.items()), "--"]


def launch_argv(tools: Mapping[str, str], *, rlimits: Mapping[str, int], uid: int | None) -> list[str]:
    """
    What ``bwrap`` starts through, each program running the next in the same process: ``prlimit``
    (``rlimits``), then ``setpriv`` to the sandbox's user (``uid``; None to stay). The worker itself
    only forks and execs, with no change of identity in between, so Python can use ``vfork``: a
    large worker does not copy its memory map for each command.
    """
    chain = rlimit_argv(tools["prlimit"], rlimits)
    if uid is not None:
        chain += [tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
    return chain


def _first_status(fd: int) -> tuple[dict[str, Any], bytes]:
    """Read bwrap's status up to its first whole line (the child's pid) or its end; return it and the rest."""
    data = b""
    while b"\n" not in data:
        piece = os.read(fd, 4096)
        if not piece:
            break
        data += piece
    line, _, rest = data.partition(b"\n")
    return status_docs(line), rest


def start(
    tools: Mapping[str, str],
    bwrap_argv: Sequence[str],
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    rlimits: Mapping[str, int],
    uid: int | None,
    placement: Placement | None = None,
    join_cgroup: Callable[[int], None] | None = None,
    held_fds: Sequence[int] = (),
    popen_kwargs: Mapping[str, Any],
) -> Started:
    """
    Start ``bwrap_argv`` (``bwrap`` and its options, no ``--``) running ``command`` through
    :func:`launch_argv`, in a session keyring of its own (``spawner.py``), with the seccomp
    filter and ``env`` handed over as descriptors, and in the sandbox's cgroup: born there with
    ``placement`` (cgroup v1), or, with ``join_cgroup``, put there before it runs anything:
    ``bwrap --block-fd`` holds the sandbox's first process after its namespaces are built;
    ``join_cgroup(pid)`` moves it (while bwrap sets up its mounts), then it goes on.

    ``held_fds``: descriptors the options name (``--bind-fd``), passed to bwrap and left open for the caller.
    ``popen_kwargs`` go to :class:`subprocess.Popen` (stdin, stdout, env); stderr is always a pipe.
    If something fails before bwrap's child exists, its status has no ``child-pid`` and stderr says why.

    :raises OSError: if the process cannot be started (the descriptors are closed).
    """
    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe() if join_cgroup is not None else (-1, -1)
    filter_fd = memfd("sandbox-seccomp", filter_program())
    args_fd = memfd("sandbox-env", env_args(env))
    inner = [str(bwrap_argv[0]), "--seccomp", str(filter_fd), "--json-status-fd", str(status_w)]
    if join_cgroup is not None:
        inner += ["--block-fd", str(block_r)]
    # The environment comes last, after any --clearenv among the options.
    inner += [*bwrap_argv[1:], "--args", str(args_fd), "--", *command]
    passed = [fd for fd in (status_w, block_r, filter_fd, args_fd) if fd >= 0]
    try:
        proc = spawn(
            [*launch_argv(tools, rlimits=rlimits, uid=uid), *inner],
            placement=placement,
            stderr=subprocess.PIPE,
            pass_fds=[*passed, *held_fds],
            # A process group of its own (the worker kills the launch by it), in the worker's session: a new
            # session would be a new scheduler autogroup, which the kernel places behind the others on a busy
            # worker (some milliseconds per command). The sandbox's own process starts its own session
            # (bwrap --new-session), with no controlling terminal.
            process_group=0,
            cwd="/",
            **popen_kwargs,
        )
    except BaseException:
        for fd in (status_r, block_w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in passed:
            os.close(fd)
    started = Started(proc, status_r)
    if join_cgroup is not None:
        _join_then_release(started, block_w, join_cgroup)
    return started


def _join_then_release(started: Started, block_w: int, join_cgroup: Callable[[int], None]) -> None:
    """Wait for bwrap's child, put it into the cgroup, then let it run (``--block-fd``); close ``block_w``."""
    try:
        started.status, rest = _first_status(started.status_fd)
        started.status.update(status_docs(rest))
        child = started.status.get("child-pid")
        if isinstance(child, int):
            join_cgroup(child)
        with contextlib.suppress(BrokenPipeError):  # bwrap already failed: the caller reads why
            os.write(block_w, b"x")
    except BaseException:
        kill_group(started.proc.pid)
        started.proc.wait()
        os.close(started.status_fd)
        raise
    finally:
        os.close(block_w)


def follow(
    started: Started,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None],
    stdin: IO[bytes] | None,
    timeout: float,
    *,
    marker_dir: str | None,
) -> tuple[bool, dict[str, Any]]:
    """
    Feed ``stdin`` to a started command and hand its output to the callbacks until it ends or
    ``timeout`` seconds pass (then its process group is killed), with a ``run-<pid>`` marker in
    ``marker_dir`` meanwhile (None for none: a sandbox with a cgroup is found through it), so a
    destroy from another process finds it. Return whether it timed out, and bwrap's whole status.
    """
    proc = started.proc
    marker = os.path.join(marker_dir, f"run-{proc.pid}") if marker_dir is not None else None
    try:
        if marker is not None:
            open(marker, "w").close()
    except OSError:
        # Destroyed between the caller's checks and now: nothing may run in a removed sandbox.
        kill_group(proc.pid)
    readers = {proc.stderr: bytes_reader(on_stderr)}
    if proc.stdout is not None:
        readers[proc.stdout] = bytes_reader(on_stdout)
    feeder = feed(proc.stdin, stdin) if stdin is not None and proc.stdin is not None else None
    try:
        timed_out = pump(proc, readers, timeout)
    except BaseException:
        kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        if feeder is not None:
            feeder.join(timeout=10)
        if marker is not None:
            with contextlib.suppress(OSError):
                os.unlink(marker)
        status = {**started.status, **read_status(started.status_fd)}
    return timed_out, status


def check_local_workdir(workdir: Any) -> str:
    """``workdir`` normalized, unless it lies in a directory the sandbox gets from the system."""
    normal = check_workdir(workdir)
    for reserved in RESERVED_WORKDIRS:
        if normal == reserved or (reserved != "/" and normal.startswith(reserved + "/")):
            raise ValueError(
                f"workdir {workdir!r} lies in {reserved}, which the sandbox gets from the system or mounts itself; "
                "use a directory of its own such as '/workspace'."
            )
    return normal
