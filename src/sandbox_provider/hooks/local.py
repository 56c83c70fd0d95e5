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
import errno
import fcntl
import io
import json
import logging
import os
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.hook import FILE_OP_TIMEOUT, TOO_LARGE_STATUS, SandboxHook, check_export_size
from sandbox_provider.sandbox.output import TailBuffer
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
    EXPIRES_AT_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_handle,
    check_path,
    check_positive,
    check_workdir,
    encode_network_policy,
    is_named_sandbox,
    new_sandbox_name,
)

log = logging.getLogger(__name__)

__all__ = ["LocalSandboxBackend", "LocalSandboxHook"]

DEFAULT_SANDBOX_TIMEOUT = 3600.0
DEFAULT_MAX_PROCESSES = 1024
#: The user a root worker runs sandboxes as.
DEFAULT_SANDBOX_UID = 65534
#: The environment bwrap itself starts with (it is visible as /proc/1/environ in the sandbox).
_BWRAP_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
#: Where a workspace may not be mounted: the system directories shown to the sandbox, and its own mounts.
_RESERVED_WORKDIRS = (
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
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc entries programs need to start and to find users, certificates and time zones. Nothing
# else of /etc is shown: it can hold credentials and the worker's configuration.
_ETC_ENTRIES = (
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
_NETWORK_ETC = ("resolv.conf", "gai.conf")
_STAMPS = "stamps.json"
_ENV = "env.json"
_EXPORT_MIN_RATE = 1024 * 1024  # bytes per second a local export is allowed to be slow to


class LocalSandboxHook(SandboxHook):
    """
    Sandboxes on the worker, isolated with bubblewrap. Attachable by tasks on the same host.

    :param sandbox_conn_id: an optional ``sandbox_local`` connection whose extras give defaults
        (``state_root``, ``image``, ``sandbox_timeout``, ``cpu_seconds``, ``memory_bytes``,
        ``max_processes``); arguments given here win. None (the default) uses no connection.
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

    conn_name_attr = "sandbox_conn_id"
    default_conn_name = "sandbox_local_default"
    conn_type = "sandbox_local"
    hook_name = "Sandbox (bubblewrap on the worker)"

    name = "local"
    attachable = True

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
        sandbox_uid: int = DEFAULT_SANDBOX_UID,
        bwrap_path: str = "bwrap",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sandbox_conn_id = sandbox_conn_id
        self._args = {
            "state_root": os.fspath(state_root) if state_root is not None else None,
            "image": os.fspath(image) if image is not None else None,
            "sandbox_timeout": check_positive(sandbox_timeout, "sandbox_timeout", allow_none=True),
            "cpu_seconds": _check_limit(cpu_seconds, "cpu_seconds"),
            "memory_bytes": _check_limit(memory_bytes, "memory_bytes"),
            "max_processes": _check_limit(max_processes, "max_processes"),
            "max_file_bytes": _check_limit(max_file_bytes, "max_file_bytes"),
        }
        self.workdir = _check_workdir(workdir)
        if isinstance(sandbox_uid, bool) or not isinstance(sandbox_uid, int) or sandbox_uid <= 0:
            raise ValueError(f"sandbox_uid must be a positive user id (not root), got {sandbox_uid!r}.")
        self.sandbox_uid = sandbox_uid
        self.bwrap_path = bwrap_path
        self._settings: dict[str, Any] | None = None
        self._probed = False

    # -- settings --------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
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
        settings: dict[str, Any] = {}
        for key, value in self._args.items():
            if value is None and extras.get(key) not in (None, ""):
                value = extras[key]
                try:
                    if key == "sandbox_timeout":
                        value = check_positive(float(value), key)
                    elif key in ("cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes"):
                        value = _check_limit(int(value), key)
                except (TypeError, ValueError) as err:
                    raise SandboxTerminalError(
                        f"Connection {self.sandbox_conn_id!r} has a bad {key!r} extra ({extras[key]!r}): {err}"
                    ) from err
            settings[key] = value
        if settings["sandbox_timeout"] is None:
            settings["sandbox_timeout"] = DEFAULT_SANDBOX_TIMEOUT
        if settings["max_processes"] is None:
            settings["max_processes"] = DEFAULT_MAX_PROCESSES
        if settings["state_root"] is None:
            settings["state_root"] = os.path.join(tempfile.gettempdir(), f"airflow-sandbox-{os.getuid()}")
        if settings["image"] is not None and not os.path.isdir(settings["image"]):
            raise SandboxTerminalError(f"image {settings['image']!r} is not a directory on this worker.")
        self._settings = settings
        return settings

    @property
    def state_root(self) -> str:
        """The directory that holds this hook's sandboxes."""
        return self._config()["state_root"]

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
            mode = os.stat(here).st_mode
            if not mode & stat.S_IXOTH:
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
        check_handle(handle)
        if not is_named_sandbox(handle):
            raise SandboxTerminalError(
                f"{handle!r} is not a local sandbox handle; handles look like airflow-sandbox-1a2b3c4d5e6f."
            )
        path = os.path.join(self._root(), handle)
        if not os.path.isdir(os.path.join(path, "workspace")):
            raise SandboxTerminalError(
                f"Sandbox {handle!r} does not exist on this worker (under {self.state_root}); it was destroyed, "
                "expired, or provisioned on another host."
            )
        return path

    # -- stamps ----------------------------------------------------------------------------------------

    def read_tags(self, handle: str) -> dict[str, str]:
        """Return the sandbox's stamps (owner, holder, expiry, network, workdir)."""
        path = os.path.join(self._dir(handle), _STAMPS)
        try:
            with open(path, encoding="utf-8") as f:
                tags = json.load(f)
        except (OSError, ValueError) as err:
            raise SandboxTerminalError(f"Sandbox {handle!r} has no readable stamps: {err}") from err
        return {str(k): str(v) for k, v in tags.items()}

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's stamps, atomically (a rename)."""
        _write_json(os.path.join(self._dir(handle), _STAMPS), dict(tags))

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
        Claim a sandbox another task on this host provisioned; see :meth:`SandboxHook.attach`.

        Here the claim is exclusive: it runs under a lock on the sandbox's stamps, so of two tasks
        attaching at once exactly one wins.
        """
        with self._stamp_lock(handle):
            return super().attach(handle, owner=owner, holder=holder)

    def release(self, handle: str, *, holder: str) -> None:
        """Clear the holder stamp if it is ``holder``'s, under the same lock as :meth:`attach`."""
        with self._stamp_lock(handle):
            super().release(handle, holder=holder)

    def _expires_at(self, handle: str) -> float | None:
        try:
            return float(self.read_tags(handle)[EXPIRES_AT_TAG])
        except (KeyError, ValueError):
            return None

    # -- lifecycle -------------------------------------------------------------------------------------

    def create(self, *, spec: SandboxSpec | None = None) -> str:
        """
        Provision a sandbox directory and return its handle.

        :raises SandboxTerminalError: for an egress allowlist (not enforced by this backend yet), a
            missing ``bwrap``, or a sandbox that cannot start on this worker.
        """
        spec = spec if spec is not None else SandboxSpec()
        if not isinstance(spec, SandboxSpec):
            raise ValueError(f"spec must be a SandboxSpec, got {type(spec).__name__}.")
        if spec.has_allowlist:
            raise SandboxTerminalError(
                "The local backend cannot enforce an egress allowlist (allow_egress_to / allow_egress_to_cidrs): "
                "a sandbox here has either no network or the worker's. Stage what the job needs with inputs or "
                "files and keep block_network=True, pass SandboxSpec(block_network=False) to accept open egress, "
                "or use a backend that enforces allowlists, such as Modal for address ranges."
            )
        self._bwrap()
        settings = self._config()
        root = self._root(create=True)
        if self._drops_root:
            self._check_reachable(root)
        try:
            self.gc_expired()
        except Exception:
            log.warning("Could not sweep expired sandboxes under %s", root, exc_info=True)
        handle = new_sandbox_name()
        path = os.path.join(root, handle)
        os.mkdir(path, self._dir_mode)
        try:
            for sub in ("workspace", "tmp"):
                os.mkdir(os.path.join(path, sub), 0o700)
                if self._drops_root:
                    os.chown(os.path.join(path, sub), self.sandbox_uid, self.sandbox_uid)
            _write_json(os.path.join(path, _ENV), dict(spec.env or {}))
            tags = {
                EXPIRES_AT_TAG: str(int(time.time() + settings["sandbox_timeout"])),
                NETWORK_TAG: encode_network_policy(spec),
                WORKDIR_TAG: self.workdir,
            }
            if spec.owner:
                tags[OWNER_TAG] = spec.owner
            _write_json(os.path.join(path, _STAMPS), tags)
            if not self._probed:
                # Once per hook: prove bubblewrap can build this sandbox here, so a worker without
                # user namespaces fails at create with bwrap's reason rather than at the first command.
                probe = self._exec(handle, ["true"], timeout=60, max_output_bytes=64 * 1024)
                if not probe.ok:
                    raise SandboxTerminalError(
                        f"A new sandbox could not run a command on this worker: {probe.stderr.strip()}"
                    )
                self._probed = True
        except BaseException:
            _remove_tree(path)
            raise
        return handle

    def destroy(self, handle: str) -> None:
        """Kill the sandbox's running commands and remove its directory. Idempotent."""
        check_handle(handle)
        if not is_named_sandbox(handle):
            raise SandboxTerminalError(f"{handle!r} is not a local sandbox handle.")
        path = os.path.join(self._root(), handle)
        if not os.path.lexists(path):
            return
        self._kill_running(path)
        _remove_tree(path)

    def gc_expired(self) -> list[str]:
        """Remove every sandbox under the state root whose lifetime has run out; return their handles."""
        root = self._root()
        removed: list[str] = []
        if not os.path.isdir(root):
            return removed
        now = time.time()
        for entry in os.listdir(root):
            if not is_named_sandbox(entry):
                continue
            try:
                with open(os.path.join(root, entry, _STAMPS), encoding="utf-8") as f:
                    expires = float(json.load(f)[EXPIRES_AT_TAG])
            except (OSError, ValueError, KeyError):
                continue
            if expires <= now:
                self.destroy(entry)
                removed.append(entry)
                log.info("Removed expired sandbox %s", entry)
        return removed

    def _kill_running(self, path: str) -> None:
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
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)

    # -- running ---------------------------------------------------------------------------------------

    def _argv(
        self, path: str, network: bool, env: Mapping[str, str], status_fd: int, *, max_file_bytes: int | None = None
    ) -> list[str]:
        settings = self._config()
        args = [
            self._bwrap(),
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
        ]
        args.append("--share-net" if network else "--unshare-net")
        image = settings["image"]
        if image:
            for entry in sorted(os.listdir(image)):
                if entry in ("proc", "dev", "tmp", "sys") or "/" + entry == self.workdir:
                    continue
                args += _bind_or_link(os.path.join(image, entry), "/" + entry)
        else:
            for directory in _SYSTEM_DIRS:
                args += _bind_or_link(directory, directory)
            etc = _ETC_ENTRIES + (_NETWORK_ETC if network else ())
            for entry in etc:
                args += _bind_or_link(os.path.join("/etc", entry), "/etc/" + entry)
        args += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--bind",
            os.path.join(path, "tmp"),
            "/tmp",
            "--bind",
            os.path.join(path, "workspace"),
            self.workdir,
            "--remount-ro",
            "/",
            "--chdir",
            self.workdir,
            "--clearenv",
        ]
        base_env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": self.workdir,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
        }
        for key, value in {**base_env, **env}.items():
            args += ["--setenv", key, value]
        limits = []
        if settings["cpu_seconds"]:
            limits.append(f"--cpu={settings['cpu_seconds']}")
        if settings["memory_bytes"]:
            limits.append(f"--as={settings['memory_bytes']}")
        if settings["max_processes"]:
            limits.append(f"--nproc={settings['max_processes']}")
        file_limit = min(x for x in (max_file_bytes, settings["max_file_bytes"], 2**62) if x)
        if file_limit < 2**62:
            limits.append(f"--fsize={file_limit}")
        if limits:
            prlimit = shutil.which("prlimit")
            if not prlimit:
                raise SandboxTerminalError(
                    "Resource limits need util-linux's prlimit on the worker; install util-linux or drop the limits."
                )
            args = [prlimit, *limits, "--", *args]
        return args

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
        max_output_bytes: int,
        stdin: IO[bytes] | None = None,
        stdout_sink: Callable[[bytes], None] | None = None,
        stdout_fd: int | None = None,
        max_file_bytes: int | None = None,
    ) -> SandboxExecResult:
        """
        Run ``argv`` in the sandbox. Standard input streams from ``stdin`` when given; standard
        output goes to ``stdout_sink`` (a callback), or straight into the file descriptor
        ``stdout_fd`` (the worker never reads it), or else into the result's tail buffer.
        """
        path = self._dir(handle)
        tags = self.read_tags(handle)
        budget = float(timeout)
        applied: float | None = None
        expires = tags.get(EXPIRES_AT_TAG)
        if expires is not None:
            left = float(expires) - time.time()
            if left <= 0:
                raise SandboxTerminalError(
                    f"Sandbox {handle} has reached the end of its lifetime; provision a new one, or give the "
                    "backend a longer sandbox_timeout."
                )
            if left < budget:
                budget = applied = max(0.5, left)
        network = '"block_network":false' in tags.get(NETWORK_TAG, "")
        with open(os.path.join(path, _ENV), encoding="utf-8") as f:
            env = json.load(f)
        status_r, status_w = os.pipe()
        try:
            args = self._argv(path, network, env, status_w, max_file_bytes=max_file_bytes) + ["--", *argv]
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_fd is None else stdout_fd,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                env=_BWRAP_ENV,
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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        out = TailBuffer(max_output_bytes)
        err_buf = TailBuffer(max(max_output_bytes, 64 * 1024))
        sink_error: list[BaseException] = []

        def to_stdout(data: bytes) -> None:
            if stdout_sink is None:
                out.write(data)
            elif not sink_error:
                try:
                    stdout_sink(data)
                except BaseException as exc:  # keep draining so the command can finish
                    sink_error.append(exc)

        readers = {proc.stderr: _bytes_reader(err_buf.write)}
        if proc.stdout is not None:
            readers[proc.stdout] = _bytes_reader(to_stdout)
        feeder = _feed(proc.stdin, stdin) if stdin is not None else None
        try:
            timed_out = _pump(proc, readers, budget)
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            if feeder is not None:
                feeder.join(timeout=10)
            with contextlib.suppress(OSError):
                os.unlink(marker)
            status = _read_status(status_r)
        if sink_error:
            raise sink_error[0]
        if not timed_out and "child-pid" not in status:
            message = err_buf.text().strip() or f"bwrap exited with status {proc.returncode}"
            if not os.path.isdir(path):
                raise SandboxTerminalError(f"Sandbox {handle} was destroyed while a command ran in it.")
            raise SandboxTerminalError(f"bubblewrap could not set up the sandbox on this worker: {message}")
        exit_code = status.get("exit-code", proc.returncode)
        if not os.path.isdir(path):
            return SandboxExecResult(
                exit_code=-1,
                stdout=out.text(),
                stderr=err_buf.text(),
                timed_out=timed_out,
                sandbox_terminated=True,
                applied_timeout=applied,
            )
        stderr = TailBuffer(max_output_bytes)
        stderr.write(err_buf.getvalue())
        return SandboxExecResult(
            exit_code=int(exit_code) if isinstance(exit_code, int) else -1,
            stdout=out.text(),
            stderr=stderr.text(),
            timed_out=timed_out,
            stdout_truncated=out.truncated,
            stderr_truncated=err_buf.truncated or stderr.truncated,
            applied_timeout=applied,
        )

    def run_command(self, handle: str, command: str, *, timeout: float, max_output_bytes: int) -> SandboxExecResult:
        """
        Run ``command`` with ``/bin/sh -c`` in the workdir of a fresh bwrap.

        On timeout the whole process tree is killed (the PID namespace goes with it, so children
        ignoring SIGTERM die too); the sandbox and its files stay. Each stream keeps its last
        ``max_output_bytes`` bytes while it is read. A timeout longer than the lifetime left is cut
        to it and reported in ``applied_timeout``.

        :raises SandboxTerminalError: if the sandbox is gone or past its lifetime.
        """
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        if not isinstance(command, str) or not command.strip() or "\0" in command:
            raise SandboxError("command must be a non-empty shell command line without NUL characters.")
        return self._exec(handle, ["/bin/sh", "-c", command], timeout=timeout, max_output_bytes=int(max_output_bytes))

    # -- files, resolved inside the sandbox ------------------------------------------------------------
    #
    # Every file operation runs in the sandbox itself, so a path (and any symlink on it) resolves the
    # way the sandbox sees it. A link pointing at a host path leads to what the sandbox can see
    # there, which is nothing of the worker's.

    def _script(self, handle: str, script: str, **kwargs: Any) -> SandboxExecResult:
        kwargs.setdefault("timeout", FILE_OP_TIMEOUT)
        kwargs.setdefault("max_output_bytes", 64 * 1024)
        return self._exec(handle, ["/bin/sh", "-c", script], **kwargs)

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

        def sink(data: bytes) -> None:
            seen[0] += len(data)
            if seen[0] <= max_bytes:
                chunks.append(data)

        script = self._checks(path, max_bytes) + f"exec head -c {int(max_bytes) + 1} -- {shlex.quote(path)}"
        result = self._script(handle, script, stdout_sink=sink)
        size = self._reported_size(result.stderr)
        if result.exit_code == TOO_LARGE_STATUS or seen[0] > max_bytes:
            raise SandboxFileTooLargeError(path, max(size or 0, seen[0]), max_bytes)
        if not result.ok:
            raise self._fail(result, path, "reading")
        return b"".join(chunks)

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into ``path`` in the sandbox, creating parent directories; return the bytes.

        The bytes go to a temporary sibling first, which is then renamed over ``path``: a reader never
        sees half a file, and a symlink at ``path`` is replaced rather than followed.

        :raises SandboxError: if the path cannot be written (a directory is there, say).
        """
        check_path(path)
        counted = _CountingReader(source)
        q = shlex.quote(path)
        script = (
            f'd=$(dirname -- {q}) && mkdir -p -- "$d" && t=$(mktemp "$d/.sandbox-write.XXXXXX") || exit 1; '
            f'if cat > "$t" && mv -fT -- "$t" {q}; then exit 0; fi; rm -f -- "$t"; exit 1'
        )
        result = self._script(handle, script, stdin=counted, timeout=max(FILE_OP_TIMEOUT, 3600.0))
        if not result.ok:
            raise self._fail(result, path, "writing")
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

        def sink(data: bytes) -> None:
            copied[0] += len(data)
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
            stream.write(data)

        allowance = max(FILE_OP_TIMEOUT, max_bytes / _EXPORT_MIN_RATE)
        checks = self._checks(path, max_bytes)
        out_fd = _local_file_fd(stream)
        if out_fd is None:
            script = checks + f"exec head -c {int(max_bytes) + 1} -- {shlex.quote(path)}"
            result = self._script(handle, script, stdout_sink=sink, timeout=allowance)
        else:
            # cat copies in the kernel where it can; the file-size limit stops it one byte past
            # the budget should the file grow during the copy.
            start = os.lseek(out_fd, 0, os.SEEK_CUR)
            script = checks + f"exec cat -- {shlex.quote(path)}"
            result = self._script(
                handle, script, stdout_fd=out_fd, timeout=allowance, max_file_bytes=start + int(max_bytes) + 1
            )
            copied[0] = os.lseek(out_fd, 0, os.SEEK_CUR) - start
            if copied[0] > max_bytes:
                raise SandboxFileTooLargeError(path, copied[0], max_bytes)
        size = self._reported_size(result.stderr)
        if result.exit_code == TOO_LARGE_STATUS:
            raise SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
        if not result.ok:
            raise self._fail(result, path, "exporting")
        if size is None:
            raise SandboxError("The sandbox did not report the size of the file being exported.")
        check_export_size(path, size, copied[0])
        return copied[0]


#: The guide's name for this backend.
LocalSandboxBackend = LocalSandboxHook


def _check_workdir(workdir: Any) -> str:
    normal = check_workdir(workdir)
    for reserved in _RESERVED_WORKDIRS:
        if normal == reserved or (reserved != "/" and normal.startswith(reserved + "/")):
            raise ValueError(
                f"workdir {workdir!r} lies in {reserved}, which the sandbox gets from the system or mounts itself; "
                "use a directory of its own such as '/workspace'."
            )
    return normal


def _check_limit(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number or None, got {value!r}.")
    return value


def _bind_or_link(source: str, dest: str) -> list[str]:
    if os.path.islink(source):
        return ["--symlink", os.readlink(source), dest]
    if os.path.exists(source):
        return ["--ro-bind", source, dest]
    return []


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _remove_tree(path: str) -> None:
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


def _bytes_reader(callback: Callable[[bytes], None]) -> Callable[[int], bool]:
    """A pipe reader for :func:`_pump` that hands each piece read to ``callback``."""

    def read(fd: int) -> bool:
        try:
            data = os.read(fd, 1024 * 1024)
        except BlockingIOError:
            return True
        if data:
            callback(data)
        return bool(data)

    return read


def _local_file_fd(stream: IO[bytes]) -> int | None:
    """The descriptor of ``stream`` if it is a regular local file with nothing buffered, else None."""
    try:
        stream.flush()
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def _pump(proc: subprocess.Popen, readers: dict[Any, Callable[[int], bool]], budget: float) -> bool:
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


def _read_status(fd: int) -> dict[str, Any]:
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


def _feed(pipe: IO[bytes], source: IO[bytes]) -> threading.Thread:
    def _pump() -> None:
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

    thread = threading.Thread(target=_pump, daemon=True, name="sandbox-import")
    thread.start()
    return thread


class _CountingReader:
    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._source.read(n)
        self.count += len(data)
        return data
