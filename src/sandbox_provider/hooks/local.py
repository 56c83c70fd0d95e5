"""
``LocalSandboxHook``: sandboxes on the worker itself, isolated by bubblewrap (``bwrap``).

The embedded default backend: no daemon, no account. A sandbox is a directory on the worker; every
command runs in a fresh ``bwrap`` with its own user, PID, IPC, UTS and (unless the spec opens it)
network namespaces. What a command sees:

- the host's system directories (``/usr``, ``/bin``, ``/lib*``, ``/sbin`` and a short list of
  harmless ``/etc`` entries), read-only, or the directory given as ``image`` as its root instead;
- the sandbox's workspace, read-write, at ``workdir`` (default ``/workspace``), and a ``/tmp`` of its
  own, both kept between commands of the same sandbox;
- a ``/proc`` showing only its own processes and a minimal ``/dev``;
- an environment holding ``PATH``, ``HOME`` (the workdir), ``LANG`` and ``spec.env``, nothing else.

It does not see the worker's home, ``AIRFLOW_HOME``, environment, processes, sockets or other
sandboxes, and it has no capabilities.

Who runs it: the worker's own user, or, when the worker runs as root, the unprivileged user
``sandbox_uid`` (default 65534, ``nobody``), so nothing in a sandbox ever holds the worker's root
identity, even inside its user namespace, and the process limit binds.

Limits are kernel resource limits on every process of a command, set with util-linux's ``prlimit``:
``max_processes`` (``RLIMIT_NPROC``, default 1024: the processes of the sandbox's user on the host,
so a fork bomb stops there), ``cpu_seconds`` (``RLIMIT_CPU``), ``memory_bytes`` (``RLIMIT_AS``, the
address space of each process) and ``max_file_bytes`` (``RLIMIT_FSIZE``, the largest file a process
may write). There is no quota on the total disk a sandbox uses: its workspace lives under
``state_root``; put that on a filesystem sized for it. A cgroup-based limit needs a delegated
cgroup, which this backend does not assume.

``block_network=False`` shares the worker's network namespace: the sandbox reaches whatever the
worker reaches, its loopback services (an API server, a database on 127.0.0.1) and abstract Unix
sockets included. Use it only for code you would let onto the worker's network.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from sandbox_provider.hooks import _local_driver as driver
from sandbox_provider.hooks.forms.local import FORM
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.attach import Attachable, expiry_of
from sandbox_provider.sandbox.errors import SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles, check_export_size, checked_size, file_failure, reported_size
from sandbox_provider.sandbox.hook import (
    FILE_OP_TIMEOUT,
    Capabilities,
    OutputSink,
    ProvisionRequest,
    RunOutcome,
    SandboxHook,
)
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
    NETWORK_TAG,
    SandboxExecResult,
    check_byte_count,
    check_path,
    check_workdir,
)

log = logging.getLogger(__name__)

__all__ = ["LocalSandboxBackend", "LocalSandboxHook"]

_STAMPS = "stamps.json"
_ENV = "env.json"
_EXPORT_MIN_RATE = 1024 * 1024  # bytes per second a local export is allowed to be slow to


class LocalSandboxHook(ShellFiles, Attachable, SandboxHook):
    """
    Sandboxes on the worker, isolated with bubblewrap. Attachable by tasks on the same host.

    :param sandbox_conn_id: an optional ``sandbox_local`` connection whose extras give defaults for
        the settings below; arguments given here win. None (the default) uses no connection.
    :param state_root: directory holding the sandboxes. Default: ``<tmp>/airflow-sandbox-<uid>``,
        so tasks on one host (LocalExecutor, ``airflow dags test``) find each other's sandboxes.
    :param image: a root filesystem directory to use, read-only, instead of the host's system
        directories (for example one made with ``debootstrap``).
    :param workdir: where the workspace is mounted inside; relative paths resolve there.
    :param sandbox_timeout: the sandbox's lifetime in seconds (default 3600). After it, commands are
        refused as terminal, and the next ``create`` on this host or :meth:`gc_expired` removes it.
    :param cpu_seconds: CPU seconds per process (``RLIMIT_CPU``); None for no limit.
    :param memory_bytes: address space per process in bytes (``RLIMIT_AS``); None for no limit.
    :param max_processes: processes of the sandbox's user on the host (``RLIMIT_NPROC``); default 1024.
    :param max_file_bytes: the largest file a process may write, in bytes (``RLIMIT_FSIZE``); None
        for no limit. Not a quota: the total a sandbox writes is not bounded.
    :param sandbox_uid: the user a root worker runs sandboxes as (default 65534, ``nobody``);
        ignored when the worker is not root. The ``image`` directory must be readable by it.
    :param bwrap_path: the bubblewrap program, by name or path.
    :raises ValueError: for a bad argument (a non-positive limit, a relative workdir).
    """

    name = "local"
    display_name = "local"
    capabilities = Capabilities(
        egress_hosts=False,
        egress_cidrs=False,
        advice=(
            "A sandbox here has either no network or the worker's. Stage what the job needs with inputs or files and "
            "keep block_network=True, pass SandboxSpec(block_network=False) to accept open egress, or use a backend "
            "that enforces allowlists, such as Modal for address ranges."
        ),
    )
    form = FORM
    test_connection_note = (
        "A task's sandboxes run on the worker that runs the task, which needs bubblewrap as this host does."
    )

    def __init__(
        self,
        sandbox_conn_id: str | None = None,
        *,
        state_root: str | os.PathLike[str] | None = None,
        image: str | os.PathLike[str] | None = None,
        workdir: str = DEFAULT_WORKDIR,
        sandbox_timeout: float | None = None,
        cpu_seconds: int | None = None,
        memory_bytes: int | None = None,
        max_processes: int | None = None,
        max_file_bytes: int | None = None,
        sandbox_uid: int | None = None,
        bwrap_path: str = "bwrap",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sandbox_conn_id = sandbox_conn_id
        self._args = self.settings.check_args(
            {
                "state_root": os.fspath(state_root) if state_root is not None else None,
                "image": os.fspath(image) if image is not None else None,
                "sandbox_timeout": sandbox_timeout,
                "cpu_seconds": cpu_seconds,
                "memory_bytes": memory_bytes,
                "max_processes": max_processes,
                "max_file_bytes": max_file_bytes,
                "sandbox_uid": sandbox_uid,
            }
        )
        self.workdir = _check_workdir(workdir)
        self.bwrap_path = bwrap_path
        self._settings: dict[str, Any] | None = None
        self._probed = False

    # -- settings --------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        if self._settings is not None:
            return self._settings
        extras: Mapping[str, Any] = {}
        if self.sandbox_conn_id:
            conn = self.get_connection(self.sandbox_conn_id)
            if conn.conn_type not in (None, "", self.conn_type):
                raise SandboxTerminalError(
                    f"Connection {self.sandbox_conn_id!r} has type {conn.conn_type!r}; LocalSandboxHook needs "
                    f"a {self.conn_type!r} connection."
                )
            extras = conn.extra_dejson
        try:
            settings = self.settings.resolve(self._args, extras, conn_id=self.sandbox_conn_id)
        except ValueError as err:
            raise SandboxTerminalError(f"{err} Fix the connection's extra, or pass the setting to the hook.") from err
        if settings["state_root"] is None:
            settings["state_root"] = os.path.join(tempfile.gettempdir(), f"airflow-sandbox-{os.getuid()}")
        if settings["image"] is not None and not os.path.isdir(settings["image"]):
            raise SandboxTerminalError(f"image {settings['image']!r} is not a directory on this worker.")
        self._settings = settings
        return settings

    @property
    def state_root(self) -> str:
        """The directory that holds this hook's sandboxes."""
        return self._resolved()["state_root"]

    @property
    def sandbox_uid(self) -> int:
        """The user a root worker runs sandboxes as."""
        return int(self._resolved()["sandbox_uid"])

    def _bwrap(self) -> str:
        found = shutil.which(self.bwrap_path)
        if not found:
            raise SandboxTerminalError(
                f"bubblewrap ({self.bwrap_path!r}) is not installed on this worker. Install the 'bubblewrap' "
                "package (apt-get install bubblewrap, dnf install bubblewrap, apk add bubblewrap) or pass "
                "bwrap_path= to LocalSandboxHook."
            )
        return found

    @property
    def _drops_root(self) -> bool:
        return os.geteuid() == 0

    @property
    def _dir_mode(self) -> int:
        # A root worker hands the sandbox to another user, who must be able to pass through.
        return 0o711 if self._drops_root else 0o700

    def _root(self, *, create: bool = False) -> str:
        root = self.state_root
        try:
            if create:
                os.makedirs(root, mode=self._dir_mode, exist_ok=True)
            info = os.lstat(root)
        except FileNotFoundError:
            return root
        except OSError as err:
            raise SandboxTerminalError(
                f"The sandbox state directory {root!r} cannot be used ({err.strerror}); pass another state_root "
                "to LocalSandboxHook or its connection."
            ) from err
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise SandboxTerminalError(
                f"The sandbox state directory {root!r} is not a directory owned by this user; pass another "
                "state_root to LocalSandboxHook."
            )
        if stat.S_IMODE(info.st_mode) != self._dir_mode:
            os.chmod(root, self._dir_mode)
        return root

    def _check_reachable(self, root: str) -> None:
        """A root worker's sandboxes run as ``sandbox_uid``, which must be able to reach the state root."""
        here = os.path.abspath(root)
        while True:
            if not os.stat(here).st_mode & stat.S_IXOTH:
                raise SandboxTerminalError(
                    f"The worker runs as root, so its sandboxes run as uid {self.sandbox_uid}, which cannot reach "
                    f"the state directory {root!r}: {here!r} is not searchable by other users. Pass a state_root "
                    "whose parent directories are (e.g. under /tmp or /var/lib), or chmod o+x that directory."
                )
            parent = os.path.dirname(here)
            if parent == here:
                return
            here = parent

    def _dir(self, handle: str) -> str:
        self.check_handle(handle)
        path = os.path.join(self._root(), handle)
        if not os.path.isdir(os.path.join(path, "workspace")):
            raise SandboxTerminalError(
                f"Sandbox {handle!r} does not exist on this worker (under {self.state_root}); it was destroyed, "
                "expired, or provisioned on another host."
            )
        return path

    # -- stamps ----------------------------------------------------------------------------------------

    def read_tags(self, handle: str) -> dict[str, str]:
        """Return the sandbox's stamps (owner, holder, expiry, network, workdir, the task that made it)."""
        path = os.path.join(self._dir(handle), _STAMPS)
        try:
            with open(path, encoding="utf-8") as f:
                tags = json.load(f)
        except (OSError, ValueError) as err:
            raise SandboxTerminalError(f"Sandbox {handle!r} has no readable stamps: {err}") from err
        return {str(k): str(v) for k, v in tags.items()}

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's stamps, atomically (a rename)."""
        driver.write_json(os.path.join(self._dir(handle), _STAMPS), dict(tags))

    @contextlib.contextmanager
    def _stamp_lock(self, handle: str):
        """Hold an exclusive lock on the sandbox's stamps, across processes of this host."""
        fd = os.open(os.path.join(self._dir(handle), "stamps.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def attach(self, handle: str, *, owner: str, holder: str):
        """
        Claim a sandbox another task on this host provisioned; see :meth:`Attachable.attach`.

        Here the claim is exclusive: it runs under a lock on the sandbox's stamps, so of two tasks
        attaching at once exactly one wins.
        """
        with self._stamp_lock(handle):
            return super().attach(handle, owner=owner, holder=holder)

    def release(self, handle: str, *, holder: str) -> None:
        """Clear the holder stamp if it is ``holder``'s, under the same lock as :meth:`attach`."""
        with self._stamp_lock(handle):
            super().release(handle, holder=holder)

    def _remaining_lifetime(self, handle: str) -> float | None:
        expires = expiry_of(self.read_tags(handle))
        return None if expires is None else expires - time.time()

    # -- lifecycle -------------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        self._bwrap()
        root = self._root(create=True)
        if self._drops_root:
            self._check_reachable(root)
        try:
            self.gc_expired()
        except Exception:
            log.warning("Could not sweep expired sandboxes under %s", root, exc_info=True)
        handle = request.name
        path = os.path.join(root, handle)
        os.mkdir(path, self._dir_mode)
        try:
            for sub in ("workspace", "tmp"):
                os.mkdir(os.path.join(path, sub), 0o700)
                if self._drops_root:
                    os.chown(os.path.join(path, sub), self.sandbox_uid, self.sandbox_uid)
            driver.write_json(os.path.join(path, _ENV), dict(request.spec.env or {}))
            driver.write_json(os.path.join(path, _STAMPS), dict(request.stamps))
            if not self._probed:
                # Once per hook: prove bubblewrap can build this sandbox here, so a worker without
                # user namespaces fails at create with bwrap's reason rather than at the first command.
                probe = self._script(handle, "true", timeout=60)
                if not probe.ok:
                    raise SandboxTerminalError(
                        f"A new sandbox could not run a command on this worker: {probe.stderr.strip()}"
                    )
                self._probed = True
        except BaseException:
            driver.remove_tree(path)
            raise
        log.info("Sandbox %s lives in %s until %s", handle, path, time.ctime(request.expires_at))
        return handle

    def _destroy(self, handle: str) -> None:
        path = os.path.join(self._root(), handle)
        if not os.path.lexists(path):
            return
        driver.kill_marked(path)
        driver.remove_tree(path)

    def gc_expired(self) -> list[str]:
        """Remove every sandbox under the state root whose lifetime has run out; return their handles."""
        root = self._root()
        removed: list[str] = []
        if not os.path.isdir(root):
            return removed
        now = time.time()
        for entry in os.listdir(root):
            if not self.handle_pattern.fullmatch(entry):
                continue
            try:
                with open(os.path.join(root, entry, _STAMPS), encoding="utf-8") as f:
                    expires = expiry_of(json.load(f))
            except (OSError, ValueError):
                continue
            if expires is not None and expires <= now:
                self.destroy(entry)
                removed.append(entry)
                log.info("Removed expired sandbox %s", entry)
        return removed

    # -- running ---------------------------------------------------------------------------------------

    def _argv(self, path: str, network: bool, env: Mapping[str, str], status_fd: int, max_file_bytes: int | None):
        settings = self._resolved()
        args = driver.bwrap_argv(
            self._bwrap(),
            path=path,
            workdir=self.workdir,
            image=settings["image"],
            network=network,
            env=env,
            status_fd=status_fd,
        )
        file_limit = min(x for x in (max_file_bytes, settings["max_file_bytes"], 2**62) if x)
        limits = {
            "cpu": settings["cpu_seconds"],
            "as": settings["memory_bytes"],
            "nproc": settings["max_processes"],
            "fsize": file_limit if file_limit < 2**62 else None,
        }
        try:
            return driver.prlimit_argv(limits) + args
        except FileNotFoundError:
            raise SandboxTerminalError(
                "Resource limits need util-linux's prlimit on the worker; install util-linux or drop the limits."
            ) from None

    def _identity(self) -> dict[str, Any]:
        if not self._drops_root:
            return {}
        return {"user": self.sandbox_uid, "group": self.sandbox_uid, "extra_groups": []}

    def _exec(
        self,
        handle: str,
        argv: list[str],
        *,
        timeout: float,
        output: OutputSink,
        stdin: IO[bytes] | None = None,
        stdout_fd: int | None = None,
        max_file_bytes: int | None = None,
    ) -> RunOutcome:
        """
        Run ``argv`` in the sandbox for at most ``timeout`` seconds. Standard input streams from
        ``stdin`` when given; standard output goes into ``output``, or straight into the file
        descriptor ``stdout_fd`` (the worker never reads it).
        """
        path = self._dir(handle)
        network = '"block_network":false' in self.read_tags(handle).get(NETWORK_TAG, "")
        with open(os.path.join(path, _ENV), encoding="utf-8") as f:
            env = json.load(f)
        status_r, status_w = os.pipe()
        try:
            args = self._argv(path, network, env, status_w, max_file_bytes) + ["--", *argv]
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_fd is None else stdout_fd,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                env=driver.BWRAP_ENV,
                **self._identity(),
            )
        except OSError as err:
            os.close(status_r)
            raise SandboxTerminalError(f"Could not start bubblewrap: {err}") from err
        finally:
            os.close(status_w)
        marker = os.path.join(path, f"run-{proc.pid}")
        try:
            open(marker, "w").close()
        except OSError:
            # Destroyed between the checks above and now: nothing may run in a removed sandbox.
            driver.kill_group(proc.pid)
        readers = {proc.stderr: driver.bytes_reader(output.stderr)}
        if proc.stdout is not None:
            readers[proc.stdout] = driver.bytes_reader(output.stdout)
        feeder = driver.feed(proc.stdin, stdin) if stdin is not None and proc.stdin is not None else None
        try:
            timed_out = driver.pump(proc, readers, timeout)
        except BaseException:
            driver.kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            if feeder is not None:
                feeder.join(timeout=10)
            with contextlib.suppress(OSError):
                os.unlink(marker)
            status = driver.read_status(status_r)
        if not os.path.isdir(path):  # destroyed while the command ran, however far bwrap had got
            return RunOutcome(exit_code=-1, timed_out=timed_out, sandbox_terminated=True)
        if not timed_out and "child-pid" not in status:
            message = output.err.text().strip() or f"bwrap exited with status {proc.returncode}"
            raise SandboxTerminalError(f"bubblewrap could not set up the sandbox on this worker: {message}")
        exit_code = status.get("exit-code", proc.returncode)
        return RunOutcome(exit_code=int(exit_code) if isinstance(exit_code, int) else -1, timed_out=timed_out)

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        # On timeout the whole process tree dies with its PID namespace (children ignoring SIGTERM
        # too); the sandbox and its files stay.
        return self._exec(handle, ["/bin/sh", "-c", command], timeout=timeout, output=output)

    # -- files, resolved inside the sandbox ------------------------------------------------------------
    #
    # Every file operation runs in the sandbox itself, so a path (and any symlink on it) resolves the
    # way the sandbox sees it. A link pointing at a host path leads to what the sandbox can see
    # there, which is nothing of the worker's. Listing comes from ShellFiles.

    def _script(
        self,
        handle: str,
        script: str,
        *,
        timeout: float = FILE_OP_TIMEOUT,
        on_stdout: Callable[[bytes], None] | None = None,
        **kwargs: Any,
    ) -> SandboxExecResult:
        handle = self.check_handle(handle)
        budget = self._deadline(handle, timeout)
        sink = OutputSink(
            64 * 1024, (lambda stream, data: on_stdout(data) if stream == "stdout" else None) if on_stdout else None
        )
        outcome = self._exec(handle, ["/bin/sh", "-c", script], timeout=budget, output=sink, **kwargs)
        return sink.result(outcome, budget)

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path``, at most ``max_bytes`` (checked in the sandbox).

        :raises SandboxFileTooLargeError: if it holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, unreadable, a directory or not a regular file.
        """
        check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        chunks: list[bytes] = []
        seen = [0]

        def keep(data: bytes) -> None:
            seen[0] += len(data)
            if seen[0] <= max_bytes:
                chunks.append(data)

        result = self._script(handle, guest.shell_command("file.sh", path, int(max_bytes), "head"), on_stdout=keep)
        size = reported_size(result.stderr)
        if result.exit_code == guest.TOO_LARGE_STATUS or seen[0] > max_bytes:
            raise SandboxFileTooLargeError(path, max(size or 0, seen[0]), max_bytes)
        if not result.ok:
            raise file_failure(result, path, "reading")
        return b"".join(chunks)

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into ``path`` in the sandbox, creating parent directories; return the bytes.

        The bytes go to a temporary sibling first, which is then renamed over ``path``: a reader never
        sees half a file, and a symlink at ``path`` is replaced rather than followed.

        :raises SandboxError: if the path cannot be written (a directory is there, say).
        """
        check_path(path)
        counted = driver.CountingReader(source)
        script = guest.shell_command("write.sh", "stdin", path)
        result = self._script(handle, script, stdin=counted, timeout=max(FILE_OP_TIMEOUT, 3600.0))
        if not result.ok:
            raise file_failure(result, path, "writing")
        return counted.count

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Stream the regular file at ``path`` into ``stream``; return the bytes copied.

        Bytes flow from the sandbox through a pipe into ``stream``, a megabyte at a time. When
        ``stream`` is a local file, the copy in the sandbox (a trusted ``cat``, in a process tree of
        its own, under a file-size limit) writes into it directly, and no byte passes through the
        worker. Either way at most ``max_bytes + 1`` bytes are written before the size is checked.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed during the copy.
        """
        check_path(path)
        check_byte_count(max_bytes, "max_bytes")
        copied = [0]

        def write(data: bytes) -> None:
            copied[0] += len(data)
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
            stream.write(data)

        allowance = max(FILE_OP_TIMEOUT, max_bytes / _EXPORT_MIN_RATE)
        out_fd = driver.local_file_fd(stream)
        if out_fd is None:
            script = guest.shell_command("file.sh", path, int(max_bytes), "head")
            result = self._script(handle, script, on_stdout=write, timeout=allowance)
        else:
            # cat copies in the kernel where it can; the file-size limit stops it one byte past
            # the budget should the file grow during the copy.
            start = os.lseek(out_fd, 0, os.SEEK_CUR)
            script = guest.shell_command("file.sh", path, int(max_bytes), "cat")
            result = self._script(
                handle, script, stdout_fd=out_fd, timeout=allowance, max_file_bytes=start + int(max_bytes) + 1
            )
            copied[0] = os.lseek(out_fd, 0, os.SEEK_CUR) - start
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
        check_export_size(path, checked_size(result, path, max_bytes, "exporting"), copied[0])
        return copied[0]


#: The guide's name for this backend.
LocalSandboxBackend = LocalSandboxHook


def _check_workdir(workdir: Any) -> str:
    normal = check_workdir(workdir)
    for reserved in driver.RESERVED_WORKDIRS:
        if normal == reserved or (reserved != "/" and normal.startswith(reserved + "/")):
            raise ValueError(
                f"workdir {workdir!r} lies in {reserved}, which the sandbox gets from the system or mounts itself; "
                "use a directory of its own such as '/workspace'."
            )
    return normal
