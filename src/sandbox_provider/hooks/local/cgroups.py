"""
Kernel control groups for the local backend: one cgroup per sandbox, holding every process of every
command it runs, with a process count (``pids.max``), a memory limit that covers what the sandbox's
processes, its tmpfs files and its page cache hold (``memory.max``; ``memory.limit_in_bytes`` and
``memory.memsw.limit_in_bytes`` on v1) and a CPU share (``cpu.max``; ``cpu.cfs_quota_us`` on v1).

Where the cgroups go: ``<parent>/<handle>``. ``parent`` is ``cgroup_parent``: a relative path lies
under the worker's own cgroup (default ``airflow-sandbox``), an absolute one is a path from the
hierarchy's root. On cgroup v2 the
controllers must be available to that parent: a worker at the root of its cgroup namespace (as in
a container) enables them itself; elsewhere, delegate a cgroup the worker does not sit in (systemd:
a slice with ``Delegate=yes``) and name it in ``cgroup_parent``. On cgroup v1 each controller's
hierarchy gets the same path. A worker that cannot write there (not root, no delegation) has no
cgroups: :func:`probe` says so once per process in the log and the caller falls back to rlimits.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_provider.hooks.forms.local import DEFAULT_CGROUP_PARENT
from sandbox_provider.hooks.local import spawner
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.processes import running

log = logging.getLogger(__name__)

__all__ = [
    "CONTROLLERS",
    "CPU_PERIOD_US",
    "Cgroups",
    "SandboxLimits",
    "check_parent",
    "confinement",
    "find",
    "plan",
    "probe",
]

#: The controllers the backend uses: pids (processes), memory, cpu (a share of the CPUs).
CONTROLLERS = ("pids", "memory", "cpu")
#: The scheduling period cpu.max / cpu.cfs_period_us is expressed in, in microseconds.
CPU_PERIOD_US = 100_000
_KILL_WAIT = 10.0  # seconds to wait for a killed sandbox's processes to leave its cgroup
_warned: set[str] = set()


@dataclass(frozen=True)
class SandboxLimits:
    """
    What a sandbox's cgroup enforces; None leaves that resource unlimited.

    :param max_processes: processes and threads at once (``pids.max``).
    :param memory_bytes: memory in bytes, tmpfs and page cache included (``memory.max``).
    :param cpu_cores: CPU time per wall-clock time, in CPUs (1.5 = one and a half cores; ``cpu.max``).
    """

    max_processes: int | None = None
    memory_bytes: int | None = None
    cpu_cores: float | None = None

    @classmethod
    def of(cls, limits: Mapping[str, Any]) -> SandboxLimits:
        """The cgroup part of a sandbox's limit record (see :func:`plan`)."""
        return cls(
            max_processes=limits.get("max_processes"),
            memory_bytes=limits.get("memory_bytes"),
            cpu_cores=limits.get("cpu_limit"),
        )

    def needs(self) -> tuple[str, ...]:
        """
        The controllers these limits need: ``pids`` always (it holds every process of the sandbox, to
        count and to kill them), ``memory`` and ``cpu`` when limited (joining a v1 hierarchy costs
        the start of every command some time, so none is joined for nothing).
        """
        wanted = {"pids": True, "memory": self.memory_bytes, "cpu": self.cpu_cores}
        return tuple(c for c in CONTROLLERS if wanted[c] is not None)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(path: str) -> list[int]:
    """The pids listed in a cgroup's ``cgroup.procs`` or ``tasks``; none for a cgroup removed (before or while read)."""
    try:
        with open(path, encoding="ascii") as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    except OSError as err:
        if err.errno == errno.ENODEV:  # v1: removed between the open and the read
            return []
        raise


class Cgroups:
    """
    Sandbox cgroups under one parent: ``version`` 2 (one directory) or 1 (one per controller).

    The parent directories are made on demand and removed, when empty, by a full sweep and when the
    worker process exits (an empty cgroup left under the worker's own would keep whoever manages
    that one from removing it).

    :param version: 1 or 2.
    :param parents: controller -> the parent directory (on v2 every controller maps to the same one).
    :param rebuild: makes the parent directories again (and hands the controllers down, on v2).
    :param mounts: on v1, each controller's mount point (for :meth:`placement`).
    """

    def __init__(
        self,
        version: int,
        parents: Mapping[str, str],
        rebuild: Callable[[], Any] | None = None,
        mounts: Mapping[str, str] | None = None,
    ) -> None:
        self.version = version
        self.parents = dict(parents)
        self.mounts = dict(mounts or {})  # v1: controller -> its hierarchy's mount point
        self._rebuild = rebuild

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(self.parents)

    def _dirs(self, handle: str, controllers: tuple[str, ...] | None = None) -> list[str]:
        """The sandbox's cgroup directories: of ``controllers`` (available ones), or every one that exists."""
        if controllers is not None:
            return sorted({os.path.join(self.parents[c], handle) for c in controllers if c in self.parents})
        return [path for path in self._paths(handle) if os.path.isdir(path)]

    def _paths(self, handle: str) -> list[str]:
        """The sandbox's cgroup directory in every controller, whether it exists or not (one path on v2)."""
        return sorted({os.path.join(parent, handle) for parent in self.parents.values()})

    def exists(self, handle: str) -> bool:
        """Whether the sandbox has a cgroup on this host (it goes at a reboot)."""
        return bool(self._dirs(handle))

    def _dir(self, handle: str, controller: str) -> str:
        return os.path.join(self.parents[controller], handle)

    def create(self, handle: str, limits: SandboxLimits) -> None:
        """Make the sandbox's cgroup in the controllers ``limits`` need, with its limits. Idempotent."""
        for path in self._dirs(handle, limits.needs()):
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            except FileNotFoundError:
                if self._rebuild is None:
                    raise
                self._rebuild()  # the parent went with its last sandbox
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o755)
        if limits.max_processes is not None:
            _write(os.path.join(self._dir(handle, "pids"), "pids.max"), str(limits.max_processes))
        if limits.memory_bytes is not None:
            self._limit_memory(self._dir(handle, "memory"), limits.memory_bytes)
        if limits.cpu_cores is not None:
            quota = max(1000, int(limits.cpu_cores * CPU_PERIOD_US))
            here = self._dir(handle, "cpu")
            if self.version == 2:
                _write(os.path.join(here, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
            else:
                _write(os.path.join(here, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(here, "cpu.cfs_quota_us"), str(quota))

    def _limit_memory(self, here: str, limit: int) -> None:
        if self.version == 2:
            _write(os.path.join(here, "memory.max"), str(limit))
            swap = os.path.join(here, "memory.swap.max")
            if os.path.exists(swap):  # swapping out would let tmpfs files grow past the limit
                _write(swap, "0")
            return
        _write(os.path.join(here, "memory.limit_in_bytes"), str(limit))
        memsw = os.path.join(here, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # memory plus swap: no more than the memory limit itself
            _write(memsw, str(limit))

    def remove_parents(self) -> None:
        """Remove the parent directories if no sandbox's cgroup is left in them (at a sweep, at exit)."""
        for parent in set(self.parents.values()):
            with contextlib.suppress(OSError):  # EBUSY while a sandbox's cgroup is in it
                os.rmdir(parent)

    def placement(self, handle: str) -> Callable[[], list[tuple[str, str]]] | None:
        """
        On v1, where a thread can sit in a cgroup of its own: for the thread that forks the
        sandbox's commands, the ``tasks`` files to move itself into and back to (computed in that
        thread, from where it is). None on v2: there :meth:`join` moves each command's first process.
        """
        if self.version != 1 or not self.mounts:
            return None
        dirs = {c: os.path.join(self.parents[c], handle) for c in self.parents}
        dirs = {c: d for c, d in dirs.items() if os.path.isdir(d)}

        def pairs() -> list[tuple[str, str]]:
            with open("/proc/thread-self/cgroup", encoding="utf-8") as f:
                here = _own_paths(f.read())
            return [
                (os.path.join(d, "tasks"), os.path.join(self.mounts[c], here.get(c, "/").lstrip("/"), "tasks"))
                for c, d in dirs.items()
            ]

        return pairs

    def join(self, handle: str, pid: int) -> None:
        """Move process ``pid`` (one that has not forked yet) into the sandbox's cgroup, every controller of it."""
        for path in self._dirs(handle):
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def members(self, handle: str) -> list[int]:
        """The processes in the sandbox's cgroup (every controller's, merged)."""
        return self._members(self._paths(handle))

    @staticmethod
    def _members(paths: list[str]) -> list[int]:
        found: set[int] = set()
        for path in paths:
            found.update(_read_pids(os.path.join(path, "cgroup.procs")))  # none where the directory is missing
        return sorted(found)

    def oom_kills(self, handle: str) -> int:
        """How many processes the kernel killed for reaching the memory limit (0 if unknown)."""
        if "memory" not in self.parents:
            return 0
        here = self._dir(handle, "memory")  # absent unless memory is limited: 0
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(here, name), encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def kill(self, handle: str) -> None:
        """SIGKILL every process of the sandbox and wait (up to 10 s) until its cgroup is empty."""
        paths = self._paths(handle)
        if self.version == 2:
            with contextlib.suppress(FileNotFoundError):  # no cgroup, or a kernel before 5.14: signalled below
                _write(os.path.join(paths[0], "cgroup.kill"), "1")
        deadline = time.monotonic() + _KILL_WAIT
        pause = 0.0002  # a command that just ended leaves within a millisecond or so
        while True:
            # Not while this worker's spawner thread sits in the cgroup (v1) to start a command there.
            with spawner.placing:
                pids = self._processes(paths)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if not pids or time.monotonic() > deadline:
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _processes(self, paths: list[str]) -> list[int]:
        """
        The processes in the cgroup directories ``paths`` that are the sandbox's own: on v1, less a
        worker whose spawner thread is visiting the cgroup to start a command there (``cgroup.procs``
        lists a process when any thread of it is in; a worker's main thread is not, where every
        sandbox process's is, or has exited).
        """
        found = self._members(paths)
        if self.version != 1 or not found:
            return found
        threads: set[int] = set()
        for path in paths:
            threads.update(_read_pids(os.path.join(path, "tasks")))
        return [pid for pid in found if pid in threads or (pid != os.getpid() and not running(pid))]

    def remove(self, handle: str) -> None:
        """Kill what runs in the sandbox's cgroup and remove it. Idempotent: a missing cgroup is fine."""
        self.kill(handle)
        deadline = time.monotonic() + _KILL_WAIT
        for path in self._dirs(handle):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    # EBUSY: a killed process is still leaving (the kernel tears the pid namespace down).
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    self.kill(handle)
                    time.sleep(0.001)


# -- finding a writable hierarchy -------------------------------------------------------------------


def _mounts(mountinfo: str) -> list[tuple[str, str, set[str]]]:
    """(mount point, ``cgroup`` or ``cgroup2``, super options) of every cgroup mount."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """The worker's cgroup per v1 controller, and under the key ``""`` its v2 cgroup."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


_PARENT_RE = re.compile(r"/?[A-Za-z0-9_.@:-]+(/[A-Za-z0-9_.@:-]+)*/?")


def check_parent(value: str) -> str:
    """
    Return ``value`` if it can name a cgroup parent: path components of letters, digits and ``_.@:-``.

    :raises ValueError: for anything else (an empty path, ``..``, spaces).
    """
    if not isinstance(value, str) or not _PARENT_RE.fullmatch(value) or ".." in value.split("/"):
        raise ValueError(
            f"cgroup_parent must be a cgroup path such as 'airflow-sandbox' or '/sandboxes.slice/airflow', got "
            f"{value!r}."
        )
    return value


def _parent_path(own: str, cgroup_parent: str | None) -> str:
    """An absolute ``cgroup_parent`` is a path from the hierarchy's root; a relative one lies under ``own``."""
    name = cgroup_parent or DEFAULT_CGROUP_PARENT
    if name.startswith("/"):
        return "/" + name.strip("/")
    return os.path.join(own, name.strip("/"))


def _v2_parent(mount: str, own: str, cgroup_parent: str | None) -> dict[str, str] | None:
    parent = os.path.join(mount, _parent_path(own, cgroup_parent).lstrip("/"))
    base = os.path.dirname(parent)
    try:
        if not set(_words(os.path.join(base, "cgroup.controllers"))) & set(CONTROLLERS):
            return None  # a hybrid host's unified hierarchy without these controllers
        # Every cgroup from the mount down to the parent hands the controllers on to its children
        # (the worker's own cgroup can do so only if it is a root: no process may sit in an inner one).
        here = mount
        for part in [p for p in os.path.relpath(base, mount).split("/") if p not in ("", ".")]:
            _enable(here)
            here = os.path.join(here, part)
        _enable(base)
        os.makedirs(parent, exist_ok=True)
        _enable(parent)
        enabled = set(_words(os.path.join(parent, "cgroup.subtree_control")))
    except OSError:
        return None
    return {c: parent for c in CONTROLLERS if c in enabled} or None


def _words(path: str) -> list[str]:
    with open(path, encoding="ascii") as f:
        return f.read().split()


def _enable(path: str) -> None:
    enabled = set(_words(os.path.join(path, "cgroup.subtree_control")))
    available = set(_words(os.path.join(path, "cgroup.controllers")))
    missing = [c for c in CONTROLLERS if c in available and c not in enabled]
    if missing:
        _write(os.path.join(path, "cgroup.subtree_control"), " ".join("+" + c for c in missing))


def _v1_parents(mounts, own: Mapping[str, str], cgroup_parent: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """The parent per controller, and each controller's mount point."""
    parents, points = {}, {}
    for point, kind, options in mounts:
        for controller in CONTROLLERS:
            if kind == "cgroup" and controller in options and controller not in parents:
                parent = os.path.join(point, _parent_path(own.get(controller, "/"), cgroup_parent).lstrip("/"))
                if _writable(parent):
                    parents[controller], points[controller] = parent, point
    return parents, points


def _writable(path: str) -> bool:
    """Whether this process may make ``path``: its nearest existing ancestor is writable to it."""
    here = path
    while not os.path.isdir(here):
        parent = os.path.dirname(here)
        if parent == here:
            return False
        here = parent
    return os.access(here, os.W_OK)


def find(mountinfo: str, proc_cgroup: str, cgroup_parent: str | None = None) -> Cgroups | None:
    """
    The writable sandbox cgroups of this worker: cgroup v2 when its unified hierarchy offers the
    controllers, else cgroup v1's hierarchies, else None. Leaves no directory behind (on v2 the
    controllers stay enabled down to the parent's parent).

    :param mountinfo: the text of ``/proc/self/mountinfo``.
    :param proc_cgroup: the text of ``/proc/self/cgroup``.
    """
    mounts = _mounts(mountinfo)
    own = _own_paths(proc_cgroup)
    for point, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            parents = _v2_parent(point, own[""], cgroup_parent)
            if parents:
                with contextlib.suppress(OSError):  # made again when a sandbox needs it
                    os.rmdir(next(iter(parents.values())))
                return Cgroups(2, parents, functools.partial(_v2_parent, point, own[""], cgroup_parent))
    parents, points = _v1_parents(mounts, own, cgroup_parent)
    if not parents:
        return None

    def rebuild() -> None:
        for parent in parents.values():
            os.makedirs(parent, exist_ok=True)

    return Cgroups(1, parents, rebuild, points)


@functools.lru_cache(maxsize=8)
def probe(cgroup_parent: str | None = None) -> Cgroups | None:
    """
    :func:`find` for this worker process, once per ``cgroup_parent``; logs once when there is none.
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mountinfo = f.read()
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            proc_cgroup = f.read()
    except OSError:
        mountinfo = proc_cgroup = ""
    found = find(mountinfo, proc_cgroup, cgroup_parent)
    if found is not None:
        atexit.register(found.remove_parents)
    key = cgroup_parent or ""
    if found is None and key not in _warned:
        _warned.add(key)
        log.warning(
            "No writable cgroup hierarchy on this worker%s: local sandboxes get rlimits instead (processes per "
            "sandbox user, no memory or CPU-share limit); a memory_bytes or cpu_limit setting will be refused.",
            f" under {cgroup_parent!r}" if cgroup_parent else "",
        )
    elif found is not None:
        missing = [c for c in CONTROLLERS if c not in found.parents]
        if missing and key not in _warned:
            _warned.add(key)
            log.warning("cgroup v%s on this worker lacks the %s controller(s)", found.version, ", ".join(missing))
    return found


# -- what a sandbox gets ----------------------------------------------------------------------------


def plan(settings: Mapping[str, Any], cgroups: Cgroups | None, *, root_worker: bool) -> dict[str, Any]:
    """
    The limit record of a new sandbox (kept with it; every command runs under it) from the hook's
    resolved ``settings``, and whether it gets a cgroup.

    :raises SandboxTerminalError: for a limit this worker cannot enforce, before anything is made.
    """
    have = set(cgroups.parents) if cgroups is not None else set()
    missing = []
    if settings["memory_bytes"] and "memory" not in have:
        missing.append("memory_bytes (a memory limit that covers tmpfs and page cache needs a memory cgroup)")
    if settings["cpu_limit"] and "cpu" not in have:
        missing.append("cpu_limit (a CPU share needs a cpu cgroup)")
    if settings["disk_bytes"] and not root_worker:
        missing.append("disk_bytes (the size-limited workspace is a tmpfs only a root worker can mount)")
    if missing:
        raise SandboxTerminalError(
            f"This worker cannot enforce {'; '.join(missing)}, and the local backend does not provision a sandbox "
            "weaker than asked. Drop those settings, or run the worker as root where it can write a cgroup "
            "hierarchy (or name a delegated one in cgroup_parent); see the README's local backend section."
        )
    return {
        "cpu_seconds": settings["cpu_seconds"],
        "cpu_limit": settings["cpu_limit"],
        "memory_bytes": settings["memory_bytes"],
        "max_file_bytes": settings["max_file_bytes"],
        "max_processes": settings["max_processes"],
        "shm_bytes": settings["shm_bytes"],
        "disk_bytes": settings["disk_bytes"],
        "cgroup": cgroups is not None,
    }


def confinement(
    handle: str, limits: Mapping[str, Any], cgroups: Cgroups | None, max_file_bytes: int | None = None
) -> tuple[Cgroups | None, dict[str, int]]:
    """
    The cgroup (None for none) and the rlimits (names of ``driver.RLIMITS``) one command of
    the sandbox runs under, given its limit record; ``max_file_bytes`` tightens the file-size limit.

    :raises SandboxTerminalError: if the sandbox has a cgroup and this worker process cannot write one.
    """
    if not limits.get("cgroup"):
        cgroups = None
    elif cgroups is None:
        raise SandboxTerminalError(
            f"Sandbox {handle} was created with a cgroup, and this worker process cannot write one: run its commands "
            "from a worker like the one that created it (root, the same cgroup_parent)."
        )
    elif not cgroups.exists(handle):
        cgroups.create(handle, SandboxLimits.of(limits))  # gone since (the host rebooted, say): made again
    rlimits = {}
    if limits.get("cpu_seconds"):
        rlimits["cpu_seconds"] = int(limits["cpu_seconds"])
    file_limit = min(x for x in (max_file_bytes, limits.get("max_file_bytes"), 2**62) if x)
    if file_limit < 2**62:
        rlimits["max_file_bytes"] = int(file_limit)
    if limits.get("max_processes") and (cgroups is None or "pids" not in cgroups.parents):
        rlimits["max_processes"] = int(limits["max_processes"])
    return cgroups, rlimits
